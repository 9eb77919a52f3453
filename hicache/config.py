"""Configuration of the cache core (the tree and its tiers). Frozen; validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hicache.config_fields import check_choices, choice

KV_ENCODINGS = ("raw", "fp8", "int8")  # hicache.tiers.kv_codec.ENCODINGS (kept torch-free here)
HOST_LAYOUTS = ("layer_first", "page_first")  # hicache.tiers.host.HOST_LAYOUTS
STORAGE_BACKENDS = ("lmdb", "mooncake")  # hicache.tiers.storage.STORAGE_BACKENDS
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")  # serving.cache.l3_prefetch.PREFETCH_POLICIES
LOAD_POLICIES = ("cost_model", "always_load")  # serving.cache.cost_model.LOAD_POLICIES
_READ_THREADS = max(1, min(16, os.cpu_count() or 1))  # hicache.tiers.storage.default_read_threads


def _write_policies() -> tuple[str, ...]:
    from hicache.hiradix.policies import WRITE_POLICIES  # the registry (imports hicache.config: read late)

    return tuple(WRITE_POLICIES)


def _eviction_policies() -> tuple[str, ...]:
    from hicache.hiradix.policies import EVICTION_POLICIES

    return tuple(EVICTION_POLICIES)


@dataclass(frozen=True)
class CacheConfig:
    """What the HiRadixTree and its pools need to know.

    Sizes of the device pool come from the engine (it knows the model's bytes per
    token); everything else lives here.
    """

    page_size: int = 16  # tokens per KV page, in every tier
    # L2 (host memory) tier, sized against the memory the host can pin: hicache_ratio x L1's bytes
    # (clamped, with a warning, when the host has less); 0 disables L2 unless L3 needs it
    hicache_ratio: float = 0.0
    hicache_size: float = 0.0  # L2 in GiB (wins over hicache_ratio when > 0); more than the host can pin is an error
    hicache_mem_layout: str = choice("layer_first", HOST_LAYOUTS)  # page_first: a page is contiguous (one L3 value)
    # when pages are copied down: to L2 on a node's first hit, after write_through_threshold hits, on eviction
    # (L3 takes every L2 page), or exclusive (a page in one tier unless hot; L2 eviction demotes to L3)
    hicache_write_policy: str = choice("write_through", _write_policies)
    # hits before write_through_selective backs a node up; in the exclusive mode, hits that make a node hot
    # (its L2 copy kept while on L1, its L3 copy kept on an L3 hit)
    write_through_threshold: int = 2
    load_back_threshold: int = 1  # pages; smaller L2 hits are recomputed instead of loaded
    # SGLang's flag: no request reuses a cached prefix (each computes its whole prompt); not with L2 / L3
    disable_radix_cache: bool = False
    eviction_policy: str = choice("lru", _eviction_policies)  # which cached pages go first when a tier is full
    # L3 (storage) tier: unset disables it. Needs L2 (an hicache_ratio of 2 is used when
    # neither L2 size is given). SGLang's flag names.
    hicache_storage_backend: str | None = choice(None, STORAGE_BACKENDS, optional=True)
    # the backend's options as JSON (lmdb: path, capacity_gb (more than its disk has free is an error), ...;
    # mooncake: master_server_address, metadata_server, global_segment_mb, ...)
    hicache_storage_backend_extra_config: dict[str, Any] = field(default_factory=dict)
    # when a request waits for its L3 prefetch: best_effort (not at all), wait_complete, timeout (base + per 1k tokens)
    hicache_storage_prefetch_policy: str = choice("best_effort", PREFETCH_POLICIES)
    hicache_storage_prefetch_threshold: int = 256  # tokens; shorter L3 hits are recomputed
    hicache_storage_prefetch_timeout_base: float = 0.5  # seconds (policy "timeout")
    hicache_storage_prefetch_timeout_per_ki_token: float = 0.25  # seconds per 1024 tokens (policy "timeout")
    cache_salt: str | None = None  # isolates this server's L3 keys from others sharing the store
    # whether an L3 hit is loaded (this and the three below are not SGLang flags; serving/cache/cost_model.py,
    # l3_writeback.py): cost_model (only when loading is faster than recomputing) | always_load
    hicache_storage_load_policy: str = choice("cost_model", LOAD_POLICIES)
    hicache_storage_read_threads: int = _READ_THREADS  # L3 reader threads (default: one per CPU, at most 16)
    hicache_storage_write_queue_pages: int = 16384  # pages handed to the L3 writers at once; the rest wait (pinned)
    hicache_storage_write_rate_mb_s: float = 0.0  # write-back bandwidth cap (0: none)
    # How pages sit in L2 / L3 (hicache.tiers.kv_codec): raw (L1's bytes) | fp8 | int8 (one byte per
    # element + a power-of-two scale per token and kv head). A lossy encoding also applies its round
    # trip when KV is stored into L1, so every tier gives back the same values (see docs/storage.md).
    hicache_l2_encoding: str = choice("raw", KV_ENCODINGS)  # how pages sit in L2 (lossy: applied in L1 too)
    hicache_l3_encoding: str = choice("raw", KV_ENCODINGS)  # how pages sit in L3 (lossy: applied in L1 too)

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.hicache_ratio < 0 or self.hicache_size < 0:
            raise ValueError("hicache_ratio and hicache_size must be >= 0")
        check_choices(self)  # layouts, policies, backend, encodings: one of their registries' names
        if not isinstance(self.hicache_storage_backend_extra_config, dict):
            raise ValueError("hicache_storage_backend_extra_config must be a mapping (a JSON object) of the "
                             "backend's options")
        if self.hicache_storage_read_threads < 1 or self.hicache_storage_write_queue_pages < 1:
            raise ValueError("hicache_storage_read_threads and hicache_storage_write_queue_pages must be >= 1")
        if self.hicache_storage_write_rate_mb_s < 0:
            raise ValueError("hicache_storage_write_rate_mb_s must be >= 0")
        if self.disable_radix_cache and self.host_enabled:
            raise ValueError("disable_radix_cache turns prefix reuse off, which L2 and L3 are for: drop it, or "
                             "--hicache-ratio / --hicache-size / --hicache-storage-backend / "
                             "--enable-hierarchical-cache")
        lossy = {e for e in (self.hicache_l2_encoding, self.hicache_l3_encoding) if e != "raw"}
        if len(lossy) > 1:
            raise ValueError(f"hicache_l2_encoding {self.hicache_l2_encoding!r} and hicache_l3_encoding "
                             f"{self.hicache_l3_encoding!r} are two different lossy encodings; a page could not "
                             "come back from both exactly: use one of them (or raw) for both")

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
