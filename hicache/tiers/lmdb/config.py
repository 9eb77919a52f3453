"""Options of the LMDB storage backend, and the constants its modules share."""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

U64 = struct.Struct(">Q")  # sequence numbers and the ``used`` counter: u64 big-endian
MIB = 1 << 20
DEFAULT_SHARDS = 4  # a new store's environments (bench/l3_write.py chose it: docs/storage.md)
MIN_SHARD_GB = 1.0  # ``shards: 0`` gives a new store no shard smaller than this
MAX_SHARDS = 64


@dataclass(frozen=True)
class LMDBConfig:
    """Options of :class:`hicache.tiers.lmdb.store.LMDBStore` (the keys of its config mapping)."""

    path: str
    capacity_gb: float = 64.0
    initial_map_mb: float = 0.0  # 0: map the whole capacity up front (sparse; no resize under load)
    sync: bool = True
    # LMDB's MDB_WRITEMAP: a write transaction writes values straight into the map (one copy less
    # than malloc'd pages written out at commit). Every process sharing the directory must agree;
    # a store larger than RAM may read pages before overwriting them (LMDB's own caveat). The map's
    # blocks are allocated on disk up front, so a full disk never meets a write into the map
    # (SIGBUS); where they cannot be, writemap is off with a warning (hicache.tiers.lmdb.disk).
    writemap: bool = False
    high_watermark: float = 0.85
    low_watermark: float = 0.75
    max_readers: int = 126
    touch_buffer: int = 65536
    # LMDB environments the store is sharded into by page key, each with its own writer thread
    # (hicache.tiers.lmdb.layout). 0: an existing store keeps its own count; a new one gets
    # DEFAULT_SHARDS, fewer where that would make a shard smaller than MIN_SHARD_GB. A count given
    # that differs from an existing store's is refused (StorageOpenError), never migrated.
    shards: int = 0
    # Other servers read this directory too (several processes on one host): the store declares
    # itself shared (StorageBackend.shared), so the exclusive tiers never delete its pages.
    shared: bool = False
    # Freed C-heap memory each writer thread keeps for the next write (hicache.tiers.lmdb.malloc: LMDB's
    # overflow pages and the framed values come from the heap instead of fresh mmaps). 0: allocator defaults.
    malloc_keep_mb: int = 256
    # Page values (4 KiB and more) written with pwrite into a slot file per value size, LMDB holding the index
    # (hicache.tiers.lmdb.value_files): one copy of each byte where LMDB's own values take two (bench/l3_write.py:
    # the tier 0.65x -> 0.84x the disk's raw rate). Not with writemap (values go into its preallocated map).
    # Reads of slotted values work either way (a process with it off still reads what one with it on wrote).
    value_files: bool = True

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("lmdb storage needs a path")
        if not isinstance(self.malloc_keep_mb, int) or isinstance(self.malloc_keep_mb, bool) or self.malloc_keep_mb < 0:
            raise ValueError(f"malloc_keep_mb must be an integer >= 0, got {self.malloc_keep_mb!r}")
        if self.capacity_gb <= 0 or self.initial_map_mb < 0:
            raise ValueError("capacity_gb must be positive and initial_map_mb >= 0")
        if not 0 < self.low_watermark <= self.high_watermark < 1:
            raise ValueError("need 0 < low_watermark <= high_watermark < 1")
        if not isinstance(self.shards, int) or isinstance(self.shards, bool) or not 0 <= self.shards <= MAX_SHARDS:
            raise ValueError(f"shards must be an integer in [0, {MAX_SHARDS}] (0: the store's own count, "
                             f"{DEFAULT_SHARDS} for a new store), got {self.shards!r}")

    def new_store_shards(self) -> int:
        """The shard count a new store gets: ``shards``, or for 0 the default, capped so that a
        shard holds at least ``MIN_SHARD_GB``."""
        if self.shards:
            return self.shards
        return max(1, min(DEFAULT_SHARDS, int(self.capacity_gb / MIN_SHARD_GB)))

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> LMDBConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(config) - known
        if unknown:
            raise ValueError(f"unknown lmdb storage options {sorted(unknown)}; known: {sorted(known)}")
        if "path" not in config:
            raise ValueError("lmdb storage needs a path")
        return cls(**config)


@dataclass(frozen=True)
class MapGeometry:
    """Sizes derived from a config once: the OS page size, the capacity (a whole number of pages,
    at least 16) and the initial map size (the capacity unless ``initial_map_mb`` is set)."""

    page: int
    capacity: int
    initial: int

    @classmethod
    def of(cls, config: LMDBConfig) -> MapGeometry:
        page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        capacity = max(16 * page, int(config.capacity_gb * 2**30) // page * page)
        initial = capacity if config.initial_map_mb <= 0 else \
            min(capacity, max(MIB, int(config.initial_map_mb * MIB)) // page * page)
        return cls(page, capacity, initial)
