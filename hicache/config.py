"""Configuration of the cache core (the tree and its tiers). Frozen; validated once."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.hicache_ratio < 0 or self.hicache_size < 0:
            raise ValueError("hicache_ratio and hicache_size must be >= 0")
        if self.hicache_mem_layout not in ("layer_first", "page_first"):
            raise ValueError(f"hicache_mem_layout must be layer_first or page_first, got {self.hicache_mem_layout!r}")

    @property
    def host_enabled(self) -> bool:
        return self.hicache_ratio > 0 or self.hicache_size > 0
