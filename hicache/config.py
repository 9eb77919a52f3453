"""Configuration of the cache core (the tree and its tiers). Frozen; validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KV_ENCODINGS = ("raw", "fp8", "int8")  # hicache.tiers.kv_codec.ENCODINGS (kept torch-free here)


@dataclass(frozen=True)
class CacheConfig:
    """What the HiRadixTree and its pools need to know.

    Sizes of the device pool come from the engine (it knows the model's bytes per
    token); everything else lives here.
    """

    page_size: int = 16
    # L2 (host) tier: 0 disables it. hicache_size (GiB) wins over hicache_ratio when > 0.
    hicache_ratio: float = 0.0
    hicache_size: float = 0.0
    hicache_mem_layout: str = "layer_first"  # or "page_first"
    hicache_write_policy: str = "write_through"  # write_through | write_through_selective | write_back
    write_through_threshold: int = 2  # hits before write_through_selective backs a node up
    load_back_threshold: int = 1  # pages; smaller L2 hits are recomputed instead of loaded
    eviction_policy: str = "lru"
    # L3 (storage) tier: None disables it. Needs L2 (an hicache_ratio of 2 is used when
    # neither L2 size is given). SGLang's flag names.
    hicache_storage_backend: str | None = None  # lmdb | mooncake
    hicache_storage_backend_extra_config: dict[str, Any] = field(default_factory=dict)  # the backend's options
    hicache_storage_prefetch_policy: str = "best_effort"  # best_effort | wait_complete | timeout
    hicache_storage_prefetch_threshold: int = 256  # tokens; shorter L3 hits are recomputed
    hicache_storage_prefetch_timeout_base: float = 0.5  # seconds (policy "timeout")
    hicache_storage_prefetch_timeout_per_ki_token: float = 0.25  # seconds per 1024 tokens (policy "timeout")
    cache_salt: str | None = None  # isolates this server's L3 keys from others sharing the store
    # L3 data path and scheduling (not SGLang flags; see serving/cost_model.py and l3_writeback.py)
    hicache_storage_load_policy: str = "cost_model"  # cost_model (load only when faster) | always_load
    hicache_storage_read_threads: int = 8  # reader threads of a direct (page_first + LMDB) read
    hicache_storage_write_queue_pages: int = 16384  # pages handed to the L3 writers at once; the rest wait (pinned)
    hicache_storage_write_rate_mb_s: float = 0.0  # write-back bandwidth cap (0: none)
    # How pages sit in L2 / L3 (hicache.tiers.kv_codec): raw (L1's bytes) | fp8 | int8 (one byte per
    # element + a power-of-two scale per token and kv head). A lossy encoding also applies its round
    # trip when KV is stored into L1, so every tier gives back the same values (see the README).
    hicache_l2_encoding: str = "raw"
    hicache_l3_encoding: str = "raw"

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.hicache_ratio < 0 or self.hicache_size < 0:
            raise ValueError("hicache_ratio and hicache_size must be >= 0")
        if self.hicache_mem_layout not in ("layer_first", "page_first"):
            raise ValueError(f"hicache_mem_layout must be layer_first or page_first, got {self.hicache_mem_layout!r}")

        if self.hicache_storage_load_policy not in ("cost_model", "always_load"):
            raise ValueError("hicache_storage_load_policy must be cost_model or always_load, "
                             f"got {self.hicache_storage_load_policy!r}")
        if self.hicache_storage_read_threads < 1 or self.hicache_storage_write_queue_pages < 1:
            raise ValueError("hicache_storage_read_threads and hicache_storage_write_queue_pages must be >= 1")
        if self.hicache_storage_write_rate_mb_s < 0:
            raise ValueError("hicache_storage_write_rate_mb_s must be >= 0")
        for name in ("hicache_l2_encoding", "hicache_l3_encoding"):
            if getattr(self, name) not in KV_ENCODINGS:
                raise ValueError(f"{name} must be one of {', '.join(KV_ENCODINGS)}, got {getattr(self, name)!r}")
        lossy = {e for e in (self.hicache_l2_encoding, self.hicache_l3_encoding) if e != "raw"}
        if len(lossy) > 1:
            raise ValueError(f"hicache_l2_encoding {self.hicache_l2_encoding!r} and hicache_l3_encoding "
                             f"{self.hicache_l3_encoding!r} are two different lossy encodings; a page could not "
                             "come back from both exactly: use one of them (or raw) for both")
        if self.hicache_storage_prefetch_policy not in ("best_effort", "wait_complete", "timeout"):
            raise ValueError("hicache_storage_prefetch_policy must be best_effort, wait_complete or timeout, "
                             f"got {self.hicache_storage_prefetch_policy!r}")

    @property
    def kv_round_trip(self) -> str:
        """The lossy encoding L1's stored KV goes through (``raw``: none)."""
        lossy = [e for e in (self.hicache_l2_encoding, self.hicache_l3_encoding) if e != "raw"]
        return lossy[0] if lossy else "raw"

    @property
    def kv_namespace_suffix(self) -> str:
        """Appended to the L3 namespace: keys of a mode with a lossy encoding live apart, so values
        of another mode are never even looked at (raw / raw keeps the namespace it always had)."""
        rt, l3 = self.kv_round_trip, self.hicache_l3_encoding
        return "" if rt == l3 == "raw" else f"|kv:{rt}:{l3}"

    @property
    def storage_enabled(self) -> bool:
        return self.hicache_storage_backend is not None

    @property
    def host_enabled(self) -> bool:
        return self.hicache_ratio > 0 or self.hicache_size > 0 or self.storage_enabled

    @property
    def effective_hicache_ratio(self) -> float:
        return self.hicache_ratio if (self.hicache_ratio > 0 or self.hicache_size > 0) else 2.0
