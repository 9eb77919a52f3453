"""What every rank of a tensor-parallel engine sets up the same way, leader (rank 0) and
followers alike: its CPU threads and its own L3 tier client."""

from __future__ import annotations

import os
from typing import Any

from serving.config import EngineConfig


def make_rank_tier(config: EngineConfig, layout: Any) -> Any:
    """This rank's StorageTier on the configured backend (every rank opens its own client)."""
    from hicache.tiers.storage import StorageTier, make_storage

    cache = config.cache
    backend = make_storage(cache.hicache_storage_backend, cache.hicache_storage_backend_extra_config)
    return StorageTier(backend, layout, cache.page_size, read_threads=cache.hicache_storage_read_threads,
                       encoding=cache.hicache_l3_encoding)


def cpu_threads_per_rank(size: int) -> int:
    """Intra-op threads of one CPU rank: the ranks share the machine's cores."""
    return max(1, (os.cpu_count() or 1) // size)
