"""The LMDB backend sharded by page key (``shards`` in its extra config), through the StorageTier
with real host pools and real LMDB environments: round trips, restarts, a store opened with another
shard count, eviction, concurrent writers and readers, a damaged value in one shard, and writes to
different shards committing at the same time."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

from harness.lmdb_pages import PS, SMALL, fill, keys_for, open_store
from hicache.tiers.base import StorageOpenError
from hicache.tiers.device import KVLayout
from hicache.tiers.host import make_host_pool
from hicache.tiers.lmdb.config import LMDBConfig
from hicache.tiers.storage import StorageTier

BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=32, dtype=torch.float16)  # 32 KiB pages


def by_shard(store, keys: list[str]) -> Counter:  # noqa: ANN001 - LMDBStore
    return Counter(store.shard_index(k) for k in keys)


@pytest.mark.parametrize("dst_layout", ["page_first", "layer_first"])
def test_sharded_store_round_trips(tmp_path, dst_layout):
    """64 pages over 4 shards: every shard holds some, each shard's entries are its keys, and a
    read (direct into a page_first pool, staged into layer_first) gives every page back."""
    store = open_store(tmp_path / "db", capacity_gb=0.2, shards=4)
    assert len(store.shards) == 4 and store.stats()["shards"] == 4
    assert (tmp_path / "db" / "shards").read_text().strip() == "4"
    tier = StorageTier(store, SMALL, PS, max_batch_pages=16)
    src = make_host_pool("page_first", SMALL, 64, PS)
    fill(src, 1)
    keys = keys_for(64)
    assert tier.batch_set(keys, src, list(range(64))) == 64
    per = by_shard(store, keys)
    assert sorted(per) == [0, 1, 2, 3], per
    assert [s.stats()["entries"] for s in store.shards] == [per[i] for i in range(4)]
    total = store.check_integrity()
    st = store.stats()
    assert total == {"entries": 64, "used_bytes": st["used_bytes"]} and st["entries"] == 64
    dst = make_host_pool(dst_layout, SMALL, 64, PS)
    assert tier.batch_get(keys, dst, list(range(64))) == 64
    assert torch.equal(dst.read_pages(torch.arange(64)), src.read_pages(torch.arange(64)))
    assert store.batch_exists(keys) == 64
    assert store.delete(keys[5]) and store.batch_exists(keys) == 5
    assert tier.stats()["corrupt"] == 0
    tier.close()


def test_restart_keeps_every_shards_pages_and_another_count_is_refused(tmp_path):
    """A closed and reopened store (``shards`` 0: the store's own count) has every shard's pages;
    a count that differs from the store's is refused in one line naming both, and a store made
    before sharding (one environment in the directory) opens as one shard."""
    path = tmp_path / "db"
    tier = StorageTier(open_store(path, capacity_gb=0.2, shards=4), SMALL, PS, max_batch_pages=8)
    src = make_host_pool("page_first", SMALL, 48, PS)
    fill(src, 2)
    keys = keys_for(48)
    assert tier.batch_set(keys, src, list(range(48))) == 48
    tier.close()
    for asked in (2, 1):
        with pytest.raises(StorageOpenError, match=rf"holds an LMDB store of 4 shards and the config asks for {asked}: "
                                                   r"give \"shards\": 4 \(or 0"):
            open_store(path, capacity_gb=0.2, shards=asked)
    store = open_store(path, capacity_gb=0.2)  # shards 0: the store's own count
    assert len(store.shards) == 4
    store.check_integrity()
    dst = make_host_pool("page_first", SMALL, 48, PS)
    tier = StorageTier(store, SMALL, PS)
    assert tier.batch_get(keys, dst, list(range(48))) == 48
    assert torch.equal(dst.buffer, src.buffer)
    tier.close()

    old = tmp_path / "one"
    open_store(old, capacity_gb=0.05, shards=1).close()  # data.mdb in the directory itself
    assert (old / "data.mdb").exists() and not (old / "shards").exists()
    with pytest.raises(StorageOpenError, match="holds an LMDB store of 1 shard and the config asks for 4"):
        open_store(old, capacity_gb=0.05, shards=4)
    assert len(open_store(old, capacity_gb=8.0).shards) == 1  # the default count applies to new stores only


def test_a_damaged_marker_or_a_bad_count_is_refused(tmp_path):
    path = tmp_path / "db"
    open_store(path, capacity_gb=0.2, shards=2).close()
    (path / "shards").write_text("lots\n")
    with pytest.raises(StorageOpenError, match="does not hold a shard count"):
        open_store(path, capacity_gb=0.2)
    for bad in (-1, 65, 2.5, True):
        with pytest.raises(ValueError, match="shards must be an integer"):
            LMDBConfig(path=str(tmp_path / "x"), shards=bad)
    # a new store: 4 shards by default, fewer where a shard would be under 1 GiB
    assert LMDBConfig(path="p", capacity_gb=64).new_store_shards() == 4
    assert LMDBConfig(path="p", capacity_gb=2.5).new_store_shards() == 2
    assert LMDBConfig(path="p", capacity_gb=0.05).new_store_shards() == 1


def test_eviction_under_capacity_spans_shards(tmp_path):
    """Far more than the capacity written: every shard evicts on its own and stays under its
    share, the store under its capacity, and the newest pages are all there."""
    store = open_store(tmp_path / "db", capacity_gb=8 / 1024, shards=4)  # 2 MiB a shard
    tier = StorageTier(store, BIG, PS, max_batch_pages=8)
    src = make_host_pool("page_first", BIG, 32, PS)
    fill(src, 3)
    for r in range(12):  # 12 x 32 pages of 32 KiB = 12 MiB into 8 MiB
        assert tier.batch_set(keys_for(32, salt=r + 1), src, list(range(32))) == 32
    for shard in store.shards:
        st = shard.stats()
        assert st["evicted"] > 0 and st["errors"] == 0, st
        assert st["used_bytes"] <= shard.capacity * shard.config.high_watermark, st
    total = store.check_integrity()
    assert total["used_bytes"] <= store.capacity * 0.85
    newest = keys_for(32, salt=12)
    dst = make_host_pool("page_first", BIG, 32, PS)
    assert tier.batch_get(newest, dst, list(range(32))) == 32
    assert torch.equal(dst.buffer, src.buffer)
    tier.close()


def test_concurrent_writers_and_readers(tmp_path):
    """4 writer threads store their own pages while 4 readers read back what is stored: every read
    gives the written bytes, nothing fails, and the shards agree with their bookkeeping after."""
    store = open_store(tmp_path / "db", capacity_gb=0.25, shards=4)
    tier = StorageTier(store, SMALL, PS, max_batch_pages=4, read_threads=2)
    src = make_host_pool("page_first", SMALL, 32, PS)
    fill(src, 4)
    sets = [keys_for(32, salt=w + 1) for w in range(4)]
    done: list[list[str]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(w: int) -> None:
        try:
            for lo in range(0, 32, 4):
                assert tier.batch_set(sets[w][lo : lo + 4], src, list(range(lo, lo + 4))) == 4
                done.append(sets[w][: lo + 4])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def reader() -> None:
        dst = make_host_pool("page_first", SMALL, 32, PS)
        try:
            while not stop.is_set():
                if not done:
                    time.sleep(0.001)
                    continue
                keys = done[-1]
                n = len(keys)
                assert tier.batch_get(keys, dst, list(range(n))) == n
                assert torch.equal(dst.buffer[:n], src.buffer[:n])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    readers = [threading.Thread(target=reader) for _ in range(4)]
    writers = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join(120)
    stop.set()
    for t in readers:
        t.join(120)
    assert not errors, errors
    assert store.check_integrity()["entries"] == 128
    st = tier.stats()
    assert st["corrupt"] == 0 and st["store_failed"] == 0 and st["backend.errors"] == 0, st
    tier.close()


def test_a_corrupted_page_in_one_shard_is_a_miss(tmp_path):
    """One payload byte flipped in the shard that holds page 10: the read stops at page 10 (a
    miss, counted and deleted), the pages before it come back, and the other shards are untouched."""
    store = open_store(tmp_path / "db", capacity_gb=0.2, shards=4)
    tier = StorageTier(store, SMALL, PS, max_batch_pages=8)
    src = make_host_pool("page_first", SMALL, 32, PS)
    fill(src, 5)
    keys = keys_for(32)
    assert tier.batch_set(keys, src, list(range(32))) == 32
    shard = store.shard_for(keys[10])
    bad = bytearray(store.get(keys[10]))  # where the store keeps it (a value file or its map)
    bad[100] ^= 0x01
    assert store.set(keys[10], bytes(bad)) and store.shard_for(keys[10]) is shard
    dst = make_host_pool("page_first", SMALL, 32, PS)
    assert tier.batch_get(keys, dst, list(range(32))) == 10
    assert torch.equal(dst.buffer[:10], src.buffer[:10])
    assert tier.stats()["corrupt"] == 1 and not store.exists(keys[10])
    assert tier.batch_get(keys[11:], dst, list(range(11, 32))) == 21  # the rest, in every shard
    assert torch.equal(dst.buffer[11:], src.buffer[11:])
    store.check_integrity()
    tier.close()


def test_each_shard_commits_on_its_own_writer(tmp_path):
    """While shard 0's writer is held (its write lock taken here), a batch's part for another shard
    commits; the batch returns once shard 0's part is in too."""
    store = open_store(tmp_path / "db", capacity_gb=0.2, shards=4)
    keys = keys_for(32)
    k0 = next(k for k in keys if store.shard_index(k) == 0)
    k1 = next(k for k in keys if store.shard_index(k) == 1)
    result: list[list[bool]] = []
    store.shards[0]._wlock.acquire()
    try:
        t = threading.Thread(target=lambda: result.append(store.batch_set([k0, k1], [b"a" * 100, b"b" * 100])))
        t.start()
        deadline = time.monotonic() + 60
        while not store.exists(k1) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert store.exists(k1) and not store.exists(k0) and not result
    finally:
        store.shards[0]._wlock.release()
    t.join(60)
    assert result == [[True, True]] and store.get(k0) == b"a" * 100
    store.close()


_FAULTS = """
import resource, sys
from hicache.tiers.lmdb.config import LMDBConfig
from hicache.tiers.lmdb.store import LMDBStore
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):  # a transaction's overflow pages: 16 values of 2 MiB, freed together at commit
        bufs = [bytearray(2 << 20) for _ in range(16)]  # zero-filled: every page touched, as a copy touches it
        del bufs
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
cold = faults()
store = LMDBStore(LMDBConfig(path=sys.argv[1], capacity_gb=0.05, malloc_keep_mb=int(sys.argv[2])))
faults()
print(cold, faults())
store.close()
"""


@pytest.mark.parametrize("keep_mb", [0, 64])
def test_an_open_store_keeps_freed_heap_for_the_next_write(tmp_path, keep_mb):
    """hicache.tiers.lmdb.malloc: a process that opened a store reuses freed multi-MiB buffers (LMDB's
    overflow pages, framed values) instead of mapping fresh zeroed pages: 8 rounds of 16 buffers of 2 MiB
    allocated and freed together (a commit's values) fault ~8,000 pages a round before and almost none after
    (a fresh process, minor page faults counted); ``malloc_keep_mb: 0`` leaves the allocator as it was."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FAULTS, str(tmp_path / "s"), str(keep_mb)], capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    cold, kept = int(out[0]), int(out[1])
    assert cold > 8 * 4000, cold
    if keep_mb:
        assert kept < cold // 20, (cold, kept)
    else:
        assert kept > cold // 2, (cold, kept)
    with pytest.raises(ValueError, match="malloc_keep_mb"):
        LMDBConfig(path=str(tmp_path), malloc_keep_mb=-1)
