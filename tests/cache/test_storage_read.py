"""L3 reads as jobs (hicache/tiers/storage_read.py) and the GIL-free page checksum.

A job's groups finish in any order while ``loaded`` only counts the verified prefix; a short
group (a miss, a corrupt value) ends it there; cancel skips what has not started; the
future resolves only once every group has ended. Driven deterministically: each group of
the unit tests waits for its own event. Then the real thing: ``StorageTier.start_read`` on
LMDB, both data paths, several jobs at once, a corrupt value in the middle.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import xxhash

from harness.lmdb_pages import PS, SMALL, fill, keys_for, open_store
from hicache.tiers import native_copy, native_hash
from hicache.tiers.host import make_host_pool
from hicache.tiers.lmdb.store import LMDBStore
from hicache.tiers.storage import ReadJob, StorageTier


class Groups:
    """run_group callables that wait, each, for the test to say how many pages land."""

    def __init__(self) -> None:
        self.go: dict[int, threading.Event] = {}
        self.got: dict[int, int] = {}
        self.started: list[int] = []
        self._lock = threading.Lock()

    def __call__(self, lo: int, hi: int) -> int:
        with self._lock:
            self.started.append(lo)
            ev = self.go.setdefault(lo, threading.Event())
        ev.wait(30)
        return self.got.get(lo, hi - lo)

    def land(self, lo: int, n: int | None = None) -> None:
        if n is not None:
            self.got[lo] = n
        with self._lock:
            ev = self.go.setdefault(lo, threading.Event())
        ev.set()


def wait_for(cond) -> None:
    ev = threading.Event()
    for _ in range(3000):
        if cond():
            return
        ev.wait(0.01)
    raise AssertionError("condition never held")


def test_loaded_counts_the_verified_prefix_whatever_order_groups_land_in():
    g = Groups()
    with ThreadPoolExecutor(4) as pool:
        job = ReadJob(10, 3, g).submit(pool)  # groups at 0, 3, 6, 9
        wait_for(lambda: len(g.started) == 4)
        assert job.reading == 10 and job.loaded == 0  # every group has started, none has landed
        g.land(6)
        g.land(9)
        wait_for(lambda: g.go[9].is_set())
        assert job.loaded == 0 and not job.done()
        g.land(0)
        wait_for(lambda: job.loaded == 3)
        g.land(3)
        assert job.result() == 10 and job.loaded == 10


def test_a_short_group_ends_the_job_and_later_groups_are_skipped():
    g = Groups()
    with ThreadPoolExecutor(1) as pool:  # one reader: groups run in order
        job = ReadJob(12, 4, g).submit(pool)
        g.land(0)
        g.land(4, 2)  # pages 4, 5 land; page 6 is a miss
        assert job.result() == 6
        assert g.started == [0, 4]  # the group at 8 never read anything


def test_cancel_skips_groups_not_started_and_the_future_waits_for_the_running_one():
    g = Groups()
    with ThreadPoolExecutor(1) as pool:
        job = ReadJob(9, 3, g).submit(pool)
        g.land(0)
        wait_for(lambda: job.loaded == 3 and 3 in g.started)
        job.cancel()
        assert not job.done()  # the group at 3 is still writing its pages
        g.land(3)
        assert job.result() == 3 and job.cancelled
        assert g.started == [0, 3]


def test_a_job_on_a_shut_down_pool_still_finishes():
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    job = ReadJob(5, 2, lambda lo, hi: hi - lo).submit(pool)
    assert job.result() == 0


@pytest.mark.parametrize("n", [0, 100, 64 << 10, (1 << 20) + 7])
def test_native_hash_is_xxh3(n):
    buf = np.random.default_rng(n).integers(0, 256, n + 3, dtype=np.uint8)
    for view in (buf[:n], buf[3:], buf[1 : n + 1].tobytes(), memoryview(bytearray(buf[:n].tobytes()))):
        assert native_hash.xxh3_64(view) == xxhash.xxh3_64_intdigest(view)


def test_native_hash_is_bound_where_xxhash_exports_it():
    import ctypes

    from xxhash import _xxhash

    lib = ctypes.CDLL(_xxhash.__file__)
    if not hasattr(lib, "XXH3_64bits_dispatch") and not hasattr(lib, "XXH3_64bits"):
        pytest.skip("this xxhash build exports no XXH3 symbol")
    assert native_hash.NATIVE  # else every reader thread would hash holding the GIL


@pytest.mark.parametrize("n", [0, 1, 1000, native_copy.CHUNK, 3 * native_copy.CHUNK + 5])
def test_copy_and_hash_copies_every_byte_and_gives_xxh3_of_each(n):
    rng = np.random.default_rng(n)
    srcs = [rng.integers(0, 256, n + 1, dtype=np.uint8)[1:] for _ in range(4)]  # unaligned sources
    dsts = [np.zeros(n, np.uint8) for _ in range(4)]
    got = native_copy.copy_and_hash(srcs, dsts)
    assert got == [xxhash.xxh3_64_intdigest(s) for s in srcs]
    assert all(np.array_equal(s, d) for s, d in zip(srcs, dsts, strict=True))
    with pytest.raises(ValueError, match="equal size"):
        native_copy.copy_and_hash([srcs[0]], [np.zeros(n + 1, np.uint8)])


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("n", [0, 1000, 3 * native_copy.CHUNK + 5])
def test_copy_and_hash_segments_copies_each_source_into_its_parts_in_order(n, native, monkeypatch):
    if not native:
        monkeypatch.setattr(native_copy, "_get", lambda: None)  # numpy's copies and xxh3: the same result
    rng = np.random.default_rng(n)
    srcs = [rng.integers(0, 256, n + 1, dtype=np.uint8)[1:] for _ in range(3)]  # unaligned sources
    cuts = [sorted({0, n, *rng.integers(0, n + 1, k).tolist()}) for k in (0, 1, 5)]  # 1, 2 and up to 6 parts
    parts = [[np.zeros(b - a, np.uint8) for a, b in zip(c, c[1:], strict=False)] for c in cuts]
    got = native_copy.copy_and_hash_segments(srcs, parts)
    assert got == [xxhash.xxh3_64_intdigest(s) for s in srcs]
    for s, c, p in zip(srcs, cuts, parts, strict=True):
        assert all(np.array_equal(s[a:b], d) for a, b, d in zip(c, c[1:], p, strict=False))
    with pytest.raises(ValueError, match="sum to the source"):
        native_copy.copy_and_hash_segments([srcs[0]], [[np.zeros(n + 1, np.uint8)]])


def test_copy_and_hash_is_native_where_a_compiler_is():
    import shutil

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here")
    native_copy.copy_and_hash([np.ones(8, np.uint8)], [np.zeros(8, np.uint8)])
    assert native_copy.NATIVE, native_copy.error  # else a reader needs the GIL twice per page


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_start_read_streams_jobs_and_stops_at_a_corrupt_value(tmp_path, layout):
    store = open_store(tmp_path / "db", capacity_gb=0.05, initial_map_mb=1)
    tier = StorageTier(store, SMALL, PS, max_batch_pages=4, read_threads=3)
    src = make_host_pool("page_first", SMALL, 48, PS)
    fill(src, 5)
    a, b = keys_for(20, salt=1), keys_for(20, salt=2)
    assert tier.batch_set(a, src, list(range(20))) == 20
    assert tier.batch_set(b, src, list(range(20, 40))) == 20
    raw = bytearray(store.get(b[13]))
    raw[len(raw) // 3] ^= 0x10  # a payload byte of b's 14th page
    assert store.set(b[13], bytes(raw))
    dst = make_host_pool(layout, SMALL, 48, PS)
    ja = tier.start_read(a, dst, list(range(20)))
    jb = tier.start_read(b, dst, list(range(20, 40)))  # in flight with ja
    assert ja.result() == 20 and jb.result() == 13
    assert torch.equal(dst.read_pages(torch.arange(33)), src.read_pages(torch.arange(33)))
    st = tier.stats()
    assert st["corrupt"] == 1 and st["hits"] == 33 and st["misses"] == 7
    assert tier.batch_exists(b) == 13  # the corrupt value was deleted
    tier.close()


def test_direct_reads_go_straight_into_the_pool(tmp_path):
    """page_first + LMDB: the direct path (one copy per page into its L2 row), in groups."""
    store = open_store(tmp_path / "db", capacity_gb=0.05, initial_map_mb=1)
    assert isinstance(store, LMDBStore) and store.direct_reads
    tier = StorageTier(store, SMALL, PS, read_threads=2)
    pool = make_host_pool("page_first", SMALL, 16, PS)
    assert tier._direct(pool) and tier.fetch_batch_pages(pool) == 8
    fill(pool, 3)
    keys = keys_for(16, salt=3)
    assert tier.batch_set(keys, pool, list(range(16))) == 16
    want = pool.read_pages(torch.arange(16))
    pool.buffer.zero_()
    job = tier.start_read(keys, pool, list(reversed(range(16))))
    assert job.result() == 16
    assert torch.equal(pool.read_pages(torch.tensor(list(reversed(range(16))))), want)
    tier.close()


def test_write_seconds_are_wall_time_not_the_sum_over_concurrent_writers(tmp_path):
    """Four writers at once (LMDB lets one write at a time): ``write_s`` is the time during which
    some write ran, at most the wall time of all four, never the sum of each one's own time."""
    import time as _time

    from harness.slow_storage import SlowLMDBStore
    from hicache.tiers.lmdb.config import LMDBConfig

    # every backend write call sleeps 0.1 s first, so the four writers overlap for certain
    store = SlowLMDBStore(LMDBConfig(path=str(tmp_path / "db"), capacity_gb=0.05, sync=False), delay_s=0.1,
                          slow_calls=("set",))
    tier = StorageTier(store, SMALL, PS, max_batch_pages=2, write_threads=4)
    pool = make_host_pool("page_first", SMALL, 32, PS)
    fill(pool, 3)
    keys = keys_for(32)
    t0 = _time.perf_counter()
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda k: tier.batch_set(keys[8 * k: 8 * k + 8], pool, list(range(8 * k, 8 * k + 8))), range(4)))
    wall = _time.perf_counter() - t0
    st = tier.stats()
    assert st["stored"] == 32
    assert 0 < st["write_s"] <= wall
    tier.close()

