"""The open LMDB environment of one store and its four named databases."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import lmdb

from hicache.tiers.lmdb.config import LMDBConfig
from hicache.tiers.lmdb.rwlock import RWLock


@dataclass(frozen=True)
class LMDBHandles:
    """The environment, its databases (layout in :mod:`hicache.tiers.lmdb.store`) and the
    :class:`RWLock` every transaction shares and a map resize takes alone. Immutable: opened
    once by the store, closed by :meth:`hicache.tiers.lmdb.store.LMDBStore.close`."""

    env: Any  # lmdb.Environment
    data: Any
    kseq: Any
    order: Any
    meta: Any
    rw: RWLock

    @classmethod
    def open(cls, config: LMDBConfig, map_size: int) -> LMDBHandles:
        os.makedirs(config.path, exist_ok=True)
        env = lmdb.open(
            config.path,
            map_size=map_size,  # the whole capacity unless initial_map_mb says otherwise: no resize under load
            max_dbs=4,
            max_readers=config.max_readers,
            sync=config.sync,
            metasync=config.sync,
            writemap=config.writemap,
            readahead=False,
            lock=True,
        )
        return cls(env, env.open_db(b"data"), env.open_db(b"kseq"), env.open_db(b"order"),
                   env.open_db(b"meta"), RWLock())
