"""Configuration of the cache core (the tree and its tiers). Frozen; validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    hicache_storage_write_queue_pages: int = 16384  # write-backs beyond this many queued pages are dropped
    hicache_storage_write_rate_mb_s: float = 0.0  # write-back bandwidth cap (0: none)

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
        if self.hicache_storage_prefetch_policy not in ("best_effort", "wait_complete", "timeout"):
            raise ValueError("hicache_storage_prefetch_policy must be best_effort, wait_complete or timeout, "
                             f"got {self.hicache_storage_prefetch_policy!r}")

    @property
    def storage_enabled(self) -> bool:
        return self.hicache_storage_backend is not None

    @property
    def host_enabled(self) -> bool:
        return self.hicache_ratio > 0 or self.hicache_size > 0 or self.storage_enabled

    @property
    def effective_hicache_ratio(self) -> float:
        return self.hicache_ratio if (self.hicache_ratio > 0 or self.hicache_size > 0) else 2.0
