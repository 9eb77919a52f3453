"""The LMDB storage backend through the StorageTier, with real host pools (no mocks).

Run as a script (``python tests/cache/test_storage_lmdb.py writer PATH``) it is the writer
process of the crash-safety test: it stores pages in a loop and prints each page's index
once its transaction is committed.
"""

from __future__ import annotations

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
from hicache.tiers.storage import StorageTier

BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=32, dtype=torch.float16)  # 32 KiB pages
REPO = Path(__file__).resolve().parents[2]


def test_writemap_store_round_trips_overwrites_and_reopens(tmp_path):
    """``writemap`` (values written straight into the map): the same values, overwrites included,
    and a reopened store (same option) finds them."""
    store = open_store(tmp_path / "db", capacity_gb=0.05, writemap=True)
    assert store.handles.env.flags()["writemap"]
    tier = StorageTier(store, SMALL, PS, max_batch_pages=4)
    src = make_host_pool("page_first", SMALL, 16, PS)
    keys = keys_for(10)
    for seed in (1, 2):  # the second pass overwrites every value
        fill(src, seed)
        assert tier.batch_set(keys, src, list(range(10))) == 10
    want = src.read_pages(torch.tensor(list(range(10))))
    store.close()
    tier2 = StorageTier(open_store(tmp_path / "db", capacity_gb=0.05, writemap=True), SMALL, PS)
    dst = make_host_pool("page_first", SMALL, 16, PS)
    assert tier2.batch_get(keys, dst, list(range(10))) == 10
    assert torch.equal(dst.read_pages(torch.tensor(list(range(10)))), want)
    assert tier2.stats()["corrupt"] == 0
    tier2.close()


@pytest.mark.parametrize("src_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("dst_layout", ["layer_first", "page_first"])
def test_round_trip_between_host_pools(tmp_path, src_layout, dst_layout):
    store = open_store(tmp_path / "db", capacity_gb=0.05, initial_map_mb=1)
    tier = StorageTier(store, SMALL, PS, max_batch_pages=4)  # several chunks per call
    src = make_host_pool(src_layout, SMALL, 16, PS)
    dst = make_host_pool(dst_layout, SMALL, 16, PS)
    fill(src, 1)
    keys = keys_for(10)
    src_pages = [9, 3, 0, 15, 7, 1, 2, 12, 4, 5]
    assert tier.batch_set(keys, src, src_pages) == 10
    assert tier.batch_exists(keys) == 10
    dst_pages = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert tier.batch_get(keys, dst, dst_pages) == 10
    want = src.read_pages(torch.tensor(src_pages))
    assert torch.equal(dst.read_pages(torch.tensor(dst_pages)), want)
    st = tier.stats()
    assert st["hits"] == 10 and st["misses"] == 0 and st["corrupt"] == 0 and st["stored"] == 10
    assert st["bytes_written"] == st["bytes_read"] == 10 * tier.codec.value_nbytes
    assert st["backend.errors"] == 0
    # another process / a restart: a reopened store finds the values
    store.close()
    tier2 = StorageTier(open_store(tmp_path / "db", capacity_gb=0.05), SMALL, PS)
    other = make_host_pool(dst_layout, SMALL, 16, PS)
    assert tier2.batch_get(keys, other, dst_pages) == 10
    assert torch.equal(other.read_pages(torch.tensor(dst_pages)), want)
    with pytest.raises(ValueError):  # a pool of another shape
        tier2.batch_get(keys[:1], make_host_pool("layer_first", BIG, 4, PS), [0])


def test_batch_exists_and_get_stop_at_the_first_miss(tmp_path):
    store = open_store(tmp_path / "db", capacity_gb=0.05)
    tier = StorageTier(store, SMALL, PS)
    pool = make_host_pool("page_first", SMALL, 8, PS)
    fill(pool, 2)
    keys = keys_for(5)
    assert tier.batch_set([keys[i] for i in (0, 1, 2, 4)], pool, [0, 1, 2, 4]) == 4
    assert tier.batch_exists(keys) == 3
    assert tier.batch_exists(keys[4:]) == 1
    assert tier.batch_exists(keys[3:]) == 0
    assert tier.batch_exists([]) == 0
    assert store.batch_exists(keys) == 3
    dst = make_host_pool("layer_first", SMALL, 8, PS)
    before = dst.read_pages(torch.tensor([3, 4])).clone()
    assert tier.batch_get(keys, dst, [0, 1, 2, 3, 4]) == 3
    assert torch.equal(dst.read_pages(torch.tensor([3, 4])), before)  # nothing past the miss
    st = tier.stats()
    assert st["hits"] == 3 and st["misses"] == 2 and st["corrupt"] == 0


def test_flipped_byte_is_rejected_counted_and_dropped(tmp_path):
    store = open_store(tmp_path / "db", capacity_gb=0.05)
    tier = StorageTier(store, SMALL, PS)
    pool = make_host_pool("layer_first", SMALL, 8, PS)
    fill(pool, 3)
    keys = keys_for(4)
    assert tier.batch_set(keys, pool, [0, 1, 2, 3]) == 4
    raw = bytearray(store.get(keys[2]))
    raw[len(raw) // 2] ^= 0x01  # one bit in the payload
    assert store.set(keys[2], bytes(raw))
    dst = make_host_pool("page_first", SMALL, 8, PS)
    assert tier.batch_get(keys, dst, [4, 5, 6, 7]) == 2  # served up to the bad page, not past it
    st = tier.stats()
    assert st["corrupt"] == 1 and st["hits"] == 2 and st["misses"] == 2
    assert not store.exists(keys[2])  # dropped, so a write-back can replace it
    assert tier.batch_exists(keys) == 2
    # a good value under the wrong key (e.g. a mixed-up copy) is rejected too
    assert store.set(keys[2], store.get(keys[3]))
    assert tier.batch_get(keys[2:3], dst, [6]) == 0 and tier.stats()["corrupt"] == 2
    # rewritten, it is served again
    assert tier.batch_set(keys[2:3], pool, [2]) == 1
    assert tier.batch_get(keys, dst, [4, 5, 6, 7]) == 4
    assert torch.equal(dst.read_pages(torch.tensor([4, 5, 6, 7])), pool.read_pages(torch.tensor([0, 1, 2, 3])))
    # a value of another layout (same key) is not served
    other = StorageTier(store, KVLayout(2, 2, 16, torch.float16), PS)
    assert other.batch_get(keys[:1], make_host_pool("layer_first", other.layout, 2, PS), [0]) == 0
    assert other.stats()["corrupt"] == 1


@pytest.mark.parametrize("value_files", [True, False], ids=["value-files", "inline"])
def test_capacity_eviction_keeps_the_store_within_capacity(tmp_path, value_files):
    cap_mb = 2
    store = open_store(tmp_path / "db", capacity_gb=cap_mb / 1024, initial_map_mb=1, value_files=value_files)
    tier = StorageTier(store, BIG, PS)
    pool = make_host_pool("page_first", BIG, 8, PS)
    fill(pool, 4)
    keep = keys_for(1, salt=999)
    assert tier.batch_set(keep, pool, [7]) == 1
    written = []
    for b in range(40):  # 40 * 4 pages * 32 KiB = 5 MiB through a 2 MiB store
        keys = keys_for(4, salt=b)
        assert tier.batch_set(keys, pool, [0, 1, 2, 3]) == 4
        written += keys
        assert tier.batch_get(keep, pool, [7]) == 1  # read often: recency keeps it
        st = store.stats()
        assert st["file_bytes"] <= cap_mb << 20 and st["map_size"] <= cap_mb << 20
        assert st["value_file_bytes"] <= cap_mb << 20 and (st["value_file_bytes"] > 0) == value_files
        assert st["used_bytes"] <= store.capacity
    st = store.stats()
    assert st["evicted"] > 0 and st["errors"] == 0
    assert 0 < st["entries"] < len(written)
    present = [store.exists(k) for k in written]
    assert all(present[-8:]), "the newest pages were evicted"
    assert not any(present[:8]), "the oldest pages survived (eviction is not by age)"
    assert store.exists(keep[0]), "a page read after every write was evicted"
    # a value that can never fit is refused, not an error
    assert store.set("k" * 32, b"x" * (3 << 20)) is False


def test_map_grows_from_a_tiny_initial_map(tmp_path):
    store = open_store(tmp_path / "db", capacity_gb=0.25, initial_map_mb=1)
    tier = StorageTier(store, BIG, PS, max_batch_pages=32)
    pool = make_host_pool("layer_first", BIG, 32, PS)
    fill(pool, 5)
    keys = keys_for(320)  # ~10 MiB
    for lo in range(0, 320, 32):
        assert tier.batch_set(keys[lo : lo + 32], pool, list(range(32))) == 32
    st = store.stats()
    assert st["map_grows"] >= 3 and st["map_size"] > 8 << 20 and st["errors"] == 0 and st["evicted"] == 0
    dst = make_host_pool("page_first", BIG, 32, PS)
    assert tier.batch_get(keys[-32:], dst, list(range(32))) == 32
    assert torch.equal(dst.read_pages(torch.arange(32)), pool.read_pages(torch.arange(32)))


def test_one_writer_and_readers_in_threads(tmp_path):
    store = open_store(tmp_path / "db", capacity_gb=2 / 1024, initial_map_mb=1)  # grows and evicts
    tier = StorageTier(store, SMALL, PS, max_batch_pages=8)
    src = make_host_pool("page_first", SMALL, 256, PS)  # 256 pages, ~2 MiB in the store
    fill(src, 6)
    keys = keys_for(256)
    errors = writer_and_readers(store, tier, src, keys, rounds=40)
    assert not errors, errors
    st = tier.stats()
    assert st["corrupt"] == 0 and st["backend.errors"] == 0 and st["hits"] > 0
    assert st["backend.evicted"] > 0 and st["backend.map_grows"] > 0


def test_killed_writer_leaves_committed_pages_intact(tmp_path):
    path = tmp_path / "db"
    committed = kill_writer(__file__, path, REPO)
    store = open_store(path, capacity_gb=0.05)
    tier = StorageTier(store, SMALL, PS)
    assert_committed(tier, committed)
    keys = keys_for(10_000)
    pool = make_host_pool("layer_first", SMALL, 1, PS)
    st = tier.stats()
    assert st["corrupt"] == 0 and st["backend.errors"] == 0
    # the store still takes writes after the crash
    assert tier.batch_set(keys[-1:], pool, [0]) == 1


def _writer(path: str) -> None:
    """Crash-test writer: store page i (two pages per transaction), print i once committed."""
    store = open_store(Path(path), capacity_gb=0.05, initial_map_mb=1)
    tier = StorageTier(store, SMALL, PS)
    pool = make_host_pool("layer_first", SMALL, 2, PS)
    keys = keys_for(10_000)
    for i in range(0, 10_000, 2):
        pool.write_pages(torch.tensor([0, 1]), torch.cat([page_data(SMALL, i), page_data(SMALL, i + 1)], dim=1))
        if tier.batch_set(keys[i : i + 2], pool, [0, 1]) == 2:
            print(f"{i}\n{i + 1}", flush=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "writer":
    _writer(sys.argv[2])


def test_direct_reads_on_threads_stop_at_the_first_bad_page(tmp_path):
    """page_first pool + LMDB: pages are copied straight from the map into L2 by 4 reader
    threads; a missing page (in the third thread's share) or a corrupt one (in the first's)
    ends the count there, whatever the other threads read."""
    store = open_store(tmp_path / "db", capacity_gb=0.05, value_files=False)  # values in the map (flipped below)
    tier = StorageTier(store, SMALL, PS, read_threads=4)
    assert tier._readers is not None
    src = make_host_pool("page_first", SMALL, 64, PS)
    fill(src, 7)
    keys = keys_for(64)
    assert tier.batch_set(keys, src, list(range(64))) == 64
    dst = make_host_pool("page_first", SMALL, 64, PS)
    assert tier.batch_get(keys, dst, list(range(64))) == 64
    assert torch.equal(dst.buffer, src.buffer)
    store.delete(keys[37])
    dst.buffer.zero_()
    assert tier.batch_get(keys, dst, list(range(64))) == 37
    assert torch.equal(dst.buffer[:37], src.buffer[:37])
    import lmdb

    env = store.handles.env
    with env.begin(write=True, db=store.handles.data) as txn:  # flip one payload byte of page 10
        bad = bytearray(txn.get(keys[10].encode()))
        bad[100] ^= 0x01
        txn.put(keys[10].encode(), bytes(bad))
    assert isinstance(env, lmdb.Environment)
    assert tier.batch_get(keys, dst, list(range(64))) == 10
    st = tier.stats()
    assert st["corrupt"] == 1 and st["hits"] == 64 + 37 + 10
    assert not store.exists(keys[10])  # deleted, so a later write can replace it
