"""The open LMDB environment of one store and its six named databases; what opening it did
about ``writemap`` (hicache.tiers.lmdb.disk), and a store that cannot be opened in one line."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import lmdb

from hicache.tiers.base import StorageOpenError
from hicache.tiers.lmdb.config import LMDBConfig
from hicache.tiers.lmdb.disk import allocate, mib, write_failure, writemap_refusal
from hicache.tiers.lmdb.rwlock import RWLock

log = logging.getLogger("hicache.storage")
FLAG = "--hicache-storage-backend-extra-config"


@dataclass(frozen=True)
class LMDBHandles:
    """The environment, its databases (layout in :mod:`hicache.tiers.lmdb.store`; ``slots`` and ``free``:
    :mod:`hicache.tiers.lmdb.value_files`) and the
    :class:`RWLock` every transaction shares and a map resize takes alone. Immutable: opened
    once by the store, closed by :meth:`hicache.tiers.lmdb.store.LMDBStore.close`.

    ``writemap``: whether the environment really writes through its map. Then the map never
    reaches past the data file's allocated blocks: :meth:`open` allocates the whole map (or
    turns writemap off, with a warning that says why), and a growth allocates before it maps
    (``LMDBAccounting.grow_map``)."""

    env: Any  # lmdb.Environment
    data: Any
    kseq: Any
    order: Any
    meta: Any
    slots: Any  # key -> (size, slot) of a value in a value file (hicache.tiers.lmdb.value_files)
    free: Any  # (size, slot) -> empty: the value files' slots given back
    rw: RWLock
    writemap: bool
    path: str  # the directory, absolute

    @property
    def data_file(self) -> str:
        return os.path.join(self.path, "data.mdb")

    @classmethod
    def open(cls, config: LMDBConfig, map_size: int) -> LMDBHandles:
        """Open (or create) the store; :class:`StorageOpenError` (one line) when what is there
        cannot be opened."""
        path = os.path.abspath(config.path)
        os.makedirs(path, exist_ok=True)
        writemap = config.writemap
        refusal = writemap_refusal(path) if writemap else None
        if refusal is not None:
            log.warning("L3: writemap is off: %s, and a write the disk has no room for would kill the process "
                        "(SIGBUS)", refusal)
            writemap = False
        env = _open_env(config, path, map_size, writemap)
        try:
            if writemap:  # before anything is written through the map (open_db may create databases)
                size = env.info()["map_size"]
                err = allocate(os.path.join(path, "data.mdb"), size)
                if err is not None:
                    env.close()
                    log.warning("L3: writemap is off: the map's %s could not be allocated on disk up front (%s); "
                                "a write into a sparse map the disk has no room for would kill the process (SIGBUS). "
                                "Lower capacity_gb or initial_map_mb in %s to keep writemap",
                                mib(size), write_failure(err, path, size), FLAG)
                    writemap = False
                    env = _open_env(config, path, map_size, False)
            # the lock file's reader slots are written through a shared map too: give it its blocks
            lock = os.path.join(path, "lock.mdb")
            if os.path.exists(lock):
                allocate(lock, os.path.getsize(lock))
            dbs = [env.open_db(name) for name in (b"data", b"kseq", b"order", b"meta", b"slots", b"free")]
        except lmdb.Error as e:
            env.close()
            raise StorageOpenError(open_failure(e, path)) from None
        except BaseException:
            env.close()
            raise
        return cls(env, *dbs, RWLock(), writemap, path)


def _open_env(config: LMDBConfig, path: str, map_size: int, writemap: bool) -> Any:
    try:
        return lmdb.open(
            path,
            map_size=map_size,  # the whole capacity unless initial_map_mb says otherwise: no resize under load
            max_dbs=6,
            max_readers=config.max_readers,
            sync=config.sync,
            metasync=config.sync,
            writemap=writemap,
            readahead=False,
            lock=True,
        )
    except lmdb.Error as e:
        raise StorageOpenError(open_failure(e, path)) from None


def open_failure(exc: lmdb.Error, path: str) -> str:
    """One line for a store that cannot be opened: the file, what is wrong, what to do."""
    data = os.path.join(path, "data.mdb")
    if isinstance(exc, lmdb.InvalidError):
        what = f"{data} is not an LMDB data file: its header is damaged or it is some other file"
    elif isinstance(exc, lmdb.VersionMismatchError):
        what = f"{data} or its lock.mdb was written by an incompatible LMDB version"
    elif isinstance(exc, lmdb.CorruptedError | lmdb.PageNotFoundError | lmdb.BadTxnError | lmdb.BadValsizeError):
        what = f"{data} is damaged: LMDB cannot read its pages"
    else:
        what = f"the LMDB store in {path} cannot be opened"
    return (f"L3: {what} (LMDB: {exc}). The store is a cache: move or delete the directory {path} (an empty "
            f"store is made in its place), or give another \"path\" in {FLAG}")
