"""How an LMDB store's directory is laid out in shards, and which shard a key belongs to.

- One shard: the environment is the directory itself (``DIR/data.mdb``, ``DIR/lock.mdb``), as a
  store made before sharding is.
- ``N > 1`` shards: ``DIR/shards`` (one line: the count) and one environment per shard,
  ``DIR/shard-0`` ... ``DIR/shard-{N-1}``. The marker is written (atomically: a temporary file
  linked into place) before any shard is created, so a process opening the directory meanwhile
  finds the count or nothing, never half of it.
- A key belongs to shard ``crc32(key) % N`` (:func:`shard_of`): stable across processes and
  restarts, spread evenly by page keys (hashes already), so one prefix's pages are spread over
  every shard and its write goes to all writers at once.

The count a directory holds is the count it is opened with. ``shards: 0`` (the default) takes it;
a count given that differs is refused with one line (:class:`StorageOpenError`): what the directory
holds, what was asked, what to do. Nothing is migrated: rehashing a store of tens of GB on every
start that changes the option would cost as much as refilling the cache, which is what deleting the
directory does.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import zlib

from hicache.tiers.base import StorageOpenError
from hicache.tiers.lmdb.config import MAX_SHARDS, LMDBConfig

MARKER = "shards"
FLAG = "--hicache-storage-backend-extra-config"


def shard_of(key: bytes, n: int) -> int:
    """The shard of ``key`` (encoded) in a store of ``n`` shards."""
    return zlib.crc32(key) % n if n > 1 else 0


def shard_configs(config: LMDBConfig) -> list[LMDBConfig]:
    """One config per shard of the store ``config`` opens (creating the layout of a new store):
    its directory, and an equal share of ``capacity_gb`` and ``initial_map_mb``."""
    path = os.path.abspath(config.path)
    os.makedirs(path, exist_ok=True)
    n = existing_shards(path)
    if n is None:
        n = config.new_store_shards()
        if n > 1:
            n = _write_marker(path, n)
    if config.shards and config.shards != n:
        raise StorageOpenError(
            f"L3: {path} holds an LMDB store of {n} shard{'s' if n > 1 else ''} and the config asks for "
            f"{config.shards}: give \"shards\": {n} (or 0: the store's own count) in {FLAG}, or move or delete "
            f"the directory {path} (the store is a cache: an empty store of {config.shards} shards is made in its "
            "place)")
    if n == 1:
        return [dataclasses.replace(config, path=path)]
    return [dataclasses.replace(config, path=os.path.join(path, f"shard-{i}"), capacity_gb=config.capacity_gb / n,
                                initial_map_mb=config.initial_map_mb / n)
            for i in range(n)]


def existing_shards(path: str) -> int | None:
    """The shard count of the store in ``path``, None where there is none yet."""
    marker = os.path.join(path, MARKER)
    if os.path.exists(marker):
        return _read_marker(marker)
    if os.path.exists(os.path.join(path, "data.mdb")):
        return 1
    return None


def _read_marker(marker: str) -> int:
    try:
        with open(marker) as f:
            text = f.read().strip()
        n = int(text)
    except (OSError, ValueError):
        n = 0
    if not 1 < n <= MAX_SHARDS:
        d = os.path.dirname(marker)
        raise StorageOpenError(f"L3: {marker} does not hold a shard count (2 to {MAX_SHARDS}): the file is damaged "
                               f"or some other file. The store is a cache: move or delete the directory {d} (an "
                               f"empty store is made in its place), or give another \"path\" in {FLAG}")
    return n


def _write_marker(path: str, n: int) -> int:
    """Write the marker of a new store of ``n`` shards; the count already there when another process
    wrote one first."""
    fd, tmp = tempfile.mkstemp(prefix=".shards-", dir=path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{n}\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, os.path.join(path, MARKER))  # atomic, and fails where one exists
        except FileExistsError:
            return _read_marker(os.path.join(path, MARKER))
    finally:
        os.unlink(tmp)
    return n
