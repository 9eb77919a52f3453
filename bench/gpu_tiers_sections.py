"""Section 1 of bench/gpu_tiers.py (the ceilings) and its helpers; see that file."""

from __future__ import annotations

import os
import threading
import time

import lmdb
import numpy as np
import torch

CHUNK = 2 << 20  # one 8B-shape page (16 tokens x 128 KiB)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def drop_page_cache(path: str) -> None:
    """Drop a file's pages from the page cache (they are read from disk next time)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def pinned(nbytes: int) -> np.ndarray:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available()).numpy()


def in_threads(n: int, fn, total: int) -> float:
    """Run ``fn(i, n)`` on ``n`` threads; GB/s for ``total`` bytes."""
    ts = [threading.Thread(target=fn, args=(i, n)) for i in range(n)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return total / (time.perf_counter() - t0) / 1e9


def ceilings(res: dict, args, work: str) -> None:
    nbytes = int(args.ceiling_gb * 2**30) // CHUNK * CHUNK
    chunks = nbytes // CHUNK
    dst = pinned(nbytes)
    threads = args.read_threads
    if torch.cuda.is_available():
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        src = torch.from_numpy(dst)
        dev.copy_(src, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(5):
            dev.copy_(src, non_blocking=True)
        sync()
        res["pinned_h2d_gbps"] = 5 * nbytes / (time.perf_counter() - t0) / 1e9
        del dev
    # a file in the page cache / on disk, read into pinned memory
    path = os.path.join(work, "ceiling.bin")
    block = np.random.default_rng(0).integers(0, 255, CHUNK, dtype=np.uint8)
    with open(path, "wb") as f:
        for _ in range(chunks):
            f.write(block)

    def file_reader(i, n):
        fd = os.open(path, os.O_RDONLY)
        try:
            for c in range(i, chunks, n):
                os.preadv(fd, [memoryview(dst[c * CHUNK:(c + 1) * CHUNK])], c * CHUNK)
        finally:
            os.close(fd)

    in_threads(1, file_reader, nbytes)  # warm
    res["file_read_1t_gbps"] = in_threads(1, file_reader, nbytes)
    res[f"file_read_{threads}t_gbps"] = in_threads(threads, file_reader, nbytes)
    drop_page_cache(path)
    res["disk_read_gbps"] = in_threads(threads, file_reader, nbytes)
    os.unlink(path)
    # LMDB raw: one write transaction of page-sized values, then view reads copied into pinned memory
    env = lmdb.open(os.path.join(work, "ceiling-lmdb"), map_size=2 * nbytes + (64 << 20), sync=False,
                    metasync=False, readahead=False, max_readers=256)
    keys = [f"{i:032x}".encode() for i in range(chunks)]
    t0 = time.perf_counter()
    with env.begin(write=True) as txn:
        for k in keys:
            txn.put(k, block)
    res["lmdb_put_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9

    def lmdb_reader(i, n):
        with env.begin(buffers=True) as txn:
            for c in range(i, chunks, n):
                np.copyto(dst[c * CHUNK:(c + 1) * CHUNK], np.frombuffer(txn.get(keys[c]), np.uint8))

    in_threads(1, lmdb_reader, nbytes)
    res["lmdb_read_1t_gbps"] = in_threads(1, lmdb_reader, nbytes)
    res[f"lmdb_read_{threads}t_gbps"] = in_threads(threads, lmdb_reader, nbytes)
    res["lmdb_read_16t_gbps"] = in_threads(16, lmdb_reader, nbytes)
    env.close()
    print(f"ceilings: { {k: round(v, 2) for k, v in res.items() if k.endswith('gbps')} }", flush=True)
