"""LMDB value files (hicache/tiers/lmdb/value_files.py, ``value_files: true``): page values pwrite'd into slot
files, LMDB holding the index, through the StorageTier with real host pools: round trips, overwrites,
restarts and misses with the values in the files (capacity eviction: tests/cache/test_storage_lmdb.py); the
tier writes an L2 page and its
trailer as parts (no framing copy); a byte flipped in a file is a corrupt value; slots given back are not
handed out while a reader may still read them (concurrent writers, readers, overwrites, deletes and eviction:
no corrupt value); a killed writer leaves every committed page; a store without the option reads what one
with it wrote (and the reverse); ``check_integrity`` after each step."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from harness.lmdb_pages import (
    PS,
    SMALL,
    assert_committed,
    fill,
    keys_for,
    kill_writer,
    open_store,
    page_data,
    writer_and_readers,
)
from hicache.tiers.device import KVLayout
from hicache.tiers.host import make_host_pool
from hicache.tiers.lmdb.value_files import SLOT
from hicache.tiers.storage import StorageTier

REPO = Path(__file__).resolve().parents[2]
BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=32, dtype=torch.float16)  # 32 KiB pages
files_store = functools.partial(open_store, value_files=True)


@pytest.mark.parametrize("src_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dst_layout", ["layer_first", "page_first"])
def test_round_trip_restart_and_misses(tmp_path, src_layout, dst_layout):
    """Pages written from either host layout read back into either, after a restart too, from the files (not
    data.mdb); a read stops at the first missing page."""
    store = files_store(tmp_path / "db", capacity_gb=0.05, initial_map_mb=1)
    tier = StorageTier(store, SMALL, PS, max_batch_pages=4)
    src, dst = make_host_pool(src_layout, SMALL, 16, PS), make_host_pool(dst_layout, SMALL, 16, PS)
    fill(src, 1)
    keys, src_pages = keys_for(10), [9, 3, 0, 15, 7, 1, 2, 12, 4, 5]
    for seed in (1, 2):  # the second pass overwrites every value (new slots, the old ones given back)
        fill(src, seed)
        assert tier.batch_set(keys, src, src_pages) == 10
    want = src.read_pages(torch.tensor(src_pages))
    store.check_integrity()
    store.close()
    store = files_store(tmp_path / "db", capacity_gb=0.05)
    tier = StorageTier(store, SMALL, PS)
    assert tier.batch_get(keys, dst, list(range(10))) == 10
    assert torch.equal(dst.read_pages(torch.arange(10)), want)
    st = store.stats()
    assert st["entries"] == 10 and st["value_file_bytes"] >= 10 * 4096, st
    with store.handles.env.begin() as txn:
        assert txn.stat(store.handles.data)["entries"] == 0 and txn.stat(store.handles.slots)["entries"] == 10
    store.delete(keys[3])
    assert tier.batch_exists(keys) == 3 and tier.batch_get(keys, dst, list(range(10))) == 3
    assert tier.stats()["corrupt"] == 0
    store.check_integrity()
    store.close()


def test_the_tier_writes_pages_as_parts_and_a_flipped_file_byte_is_caught(tmp_path):
    """A ``page_first`` pool: the tier hands the backend each L2 page and its trailer (batch_set_parts); a
    byte flipped in the value file is a corrupt value: dropped, its slot given back, written again."""
    store = files_store(tmp_path / "db", capacity_gb=0.05)
    assert store.writes_parts
    tier = StorageTier(store, SMALL, PS, max_batch_pages=4)
    src = make_host_pool("page_first", SMALL, 16, PS)
    fill(src, 8)
    keys = keys_for(12)
    calls = []
    parts = store.batch_set_parts
    store.batch_set_parts = lambda k, p: calls.append(len(k)) or parts(k, p)
    assert tier.batch_set(keys, src, list(range(12))) == 12
    assert calls == [4, 4, 4]
    store.check_integrity()
    kb = keys[5].encode()
    shard = store.shard_for(keys[5])
    with shard.txn() as txn:
        size, slot = SLOT.unpack(txn.get(kb, db=shard.handles.slots))
    with open(shard.acct.files.file(size), "r+b") as f:
        f.seek(slot * size + 100)
        b = f.read(1)
        f.seek(slot * size + 100)
        f.write(bytes([b[0] ^ 1]))
    dst = make_host_pool("page_first", SMALL, 16, PS)
    assert tier.batch_get(keys, dst, list(range(12))) == 5
    assert tier.stats()["corrupt"] == 1 and not store.exists(keys[5])
    store.check_integrity()
    assert tier.batch_set(keys[5:6], src, [5]) == 1
    assert tier.batch_get(keys, dst, list(range(12))) == 12
    assert torch.equal(dst.buffer[:12], src.buffer[:12])
    store.check_integrity()
    store.close()


def test_writers_readers_overwrites_and_eviction_read_no_reused_slot(tmp_path):
    """One writer rewriting and deleting keys through a store that evicts, two readers: a slot given back is
    handed out again only once no open read transaction can still find it under its old key, so no reader
    ever copies another key's bytes (no corrupt value; handing freed slots out at once gave 2-3 of them)."""
    store = files_store(tmp_path / "db", capacity_gb=2 / 1024, initial_map_mb=1)
    tier = StorageTier(store, SMALL, PS, max_batch_pages=8)
    src = make_host_pool("page_first", SMALL, 256, PS)
    fill(src, 6)
    keys = keys_for(256)
    errors = writer_and_readers(store, tier, src, keys, rounds=60)
    assert not errors, errors
    st = tier.stats()
    assert st["corrupt"] == 0 and st["backend.errors"] == 0 and st["hits"] > 0 and st["backend.evicted"] > 0, st
    store.check_integrity()
    store.close()


def test_a_store_without_value_files_reads_theirs_and_the_reverse(tmp_path):
    """Servers sharing a directory need not agree on the option: reads find a value wherever it is; writes
    follow each store's own option; the index stays whole."""
    keys = keys_for(8)
    src = make_host_pool("page_first", SMALL, 8, PS)
    fill(src, 9)
    on = StorageTier(files_store(tmp_path / "db", capacity_gb=0.05), SMALL, PS)
    assert on.batch_set(keys[:4], src, [0, 1, 2, 3]) == 4
    on.close()
    off = StorageTier(open_store(tmp_path / "db", capacity_gb=0.05), SMALL, PS)
    assert off.batch_set(keys[4:], src, [4, 5, 6, 7]) == 4  # inline
    assert off.batch_set(keys[:1], src, [0]) == 1  # an overwrite moves it inline, its slot given back
    dst = make_host_pool("layer_first", SMALL, 8, PS)
    assert off.batch_get(keys, dst, list(range(8))) == 8
    assert torch.equal(dst.read_pages(torch.arange(8)), src.read_pages(torch.arange(8)))
    off.backend.check_integrity()
    off.close()
    on = StorageTier(files_store(tmp_path / "db", capacity_gb=0.05), SMALL, PS)
    dst.buffer.zero_()
    assert on.batch_get(keys, dst, list(range(8))) == 8 and on.stats()["corrupt"] == 0
    assert torch.equal(dst.read_pages(torch.arange(8)), src.read_pages(torch.arange(8)))
    on.backend.check_integrity()
    on.close()


def test_killed_writer_leaves_committed_pages_intact(tmp_path):
    """A writer process killed while writing: every page it printed as committed reads back whole (the value
    file is synced before the index names it), and the store takes writes again."""
    path = tmp_path / "db"
    committed = kill_writer(__file__, path, REPO)
    store = files_store(path, capacity_gb=0.05)
    store.check_integrity()
    tier = StorageTier(store, SMALL, PS)
    assert_committed(tier, committed)
    keys = keys_for(10_000)
    pool = make_host_pool("layer_first", SMALL, 1, PS)
    assert tier.stats()["corrupt"] == 0
    assert tier.batch_set(keys[-1:], pool, [0]) == 1
    store.check_integrity()
    tier.close()


def _writer(path: str) -> None:
    tier = StorageTier(files_store(Path(path), capacity_gb=0.05, initial_map_mb=1), SMALL, PS)
    pool = make_host_pool("page_first", SMALL, 2, PS)
    keys = keys_for(10_000)
    for i in range(0, 10_000, 2):
        pool.write_pages(torch.tensor([0, 1]), torch.cat([page_data(SMALL, i), page_data(SMALL, i + 1)],
                                                         dim=1))
        if tier.batch_set(keys[i: i + 2], pool, [0, 1]) == 2:
            print(f"{i}\n{i + 1}", flush=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "writer":
    _writer(sys.argv[2])


def test_a_cleared_store_gives_the_files_blocks_back(tmp_path):
    """clear(): no entry left, the files' blocks given back (holes punched, the length kept: a map still open
    reads zeros, never past the end), and the store takes writes again."""
    store = files_store(tmp_path / "db", capacity_gb=0.05)
    tier = StorageTier(store, SMALL, PS)
    src = make_host_pool("page_first", SMALL, 16, PS)
    fill(src, 3)
    keys = keys_for(16)
    assert tier.batch_set(keys, src, list(range(16))) == 16
    before = store.stats()["value_file_bytes"]
    view = store.shard_for(keys[0]).acct.files.view(tier.codec.value_nbytes, 0)  # a reader's map stays valid
    store.clear()
    st = store.stats()
    assert st["entries"] == 0 and before >= 16 * 4096 and st["value_file_bytes"] < before // 4, (before, st)
    assert bytes(view[:64]) == bytes(64)
    store.check_integrity()
    assert tier.batch_set(keys[:4], src, [0, 1, 2, 3]) == 4
    dst = make_host_pool("page_first", SMALL, 16, PS)
    assert tier.batch_get(keys, dst, list(range(16))) == 4 and torch.equal(dst.buffer[:4], src.buffer[:4])
    store.check_integrity()
    del view
    store.close()
