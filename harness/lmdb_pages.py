"""A real LMDB store with small pages for the storage tests: the layout, filled pools, keys."""

from __future__ import annotations

from pathlib import Path

import torch

from hicache.keys import namespace_for, page_keys
from hicache.tiers.device import KVLayout
from hicache.tiers.lmdb.store import LMDBStore
from hicache.tiers.storage import make_storage

PS = 16

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)  # 4 KiB pages


NS = namespace_for("test/model", SMALL, page_size=PS)


def fill(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(pool.buffer.dtype))


def keys_for(n: int, salt: int = 0) -> list[str]:
    return page_keys([(salt * 7919 + t) % 50000 for t in range(n * PS)], PS, NS)


def open_store(path: Path, **kw) -> LMDBStore:
    return make_storage("lmdb", {"path": str(path), **kw})
