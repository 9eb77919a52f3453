"""Sections 1-2 of bench/gpu.py (split out to keep files small): the timing helpers, the
copy ceilings and the L1 <-> L2 page moves. See bench/gpu.py for what is measured and how.

Copies and page moves are timed queued back to back between two CUDA events (sustained rate,
as asynchronous moves run in serving); ``*_single_gbps`` times one call at a time, the host's
preparation included.
"""

from __future__ import annotations

import random
import statistics
import time

import torch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync() -> None:
    if torch.cuda.is_available():  # a CPU smoke run has nothing to wait for
        torch.cuda.synchronize()


def cuda_time(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``fn`` by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def queued_time(fn, reps: int = 10, warmup: int = 1) -> float:
    """Seconds per call of ``fn`` queued back to back (one event pair around all calls): the
    sustained rate of asynchronous moves, host overhead hidden behind the GPU as in serving."""
    for _ in range(warmup):
        fn()
    sync()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def wall_time(fn, reps: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- 1. ceilings ----------------------------------------------------------------------------
def ceilings(res: dict, quick: bool) -> None:
    n = (1 << 30) if not quick else (1 << 28)  # bytes
    a = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    t = cuda_time(lambda: b.copy_(a), reps=10)
    res["hbm_copy_gbps"] = 2 * n / t / 1e9  # read + write
    n = 512 << 20
    dev = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    host = torch.empty(n // 2, dtype=torch.bfloat16, pin_memory=True)
    res["pinned_d2h_gbps"] = n / queued_time(lambda: host.copy_(dev, non_blocking=True)) / 1e9
    res["pinned_h2d_gbps"] = n / queued_time(lambda: dev.copy_(host, non_blocking=True)) / 1e9
    res["copy_ceiling_gbps"] = (res["pinned_d2h_gbps"] + res["pinned_h2d_gbps"]) / 2
    log(f"HBM copy {res['hbm_copy_gbps']:.0f} GB/s; pinned D2H {res['pinned_d2h_gbps']:.1f}, "
        f"H2D {res['pinned_h2d_gbps']:.1f} GB/s")


# -- 2. page moves --------------------------------------------------------------------------
def page_moves(res: dict, checks: dict, quick: bool) -> None:
    from hicache.tiers.device import DeviceKVPool, KVLayout
    from hicache.tiers.host import make_host_pool
    from serving.kernels import page_copy_triton as pct
    from serving.kernels.page_copy import PageMover

    lay = KVLayout(32, 8, 128, torch.bfloat16)  # the 8B model's KV: 2 MiB per 16-token page
    ps, pool_pages, n = 16, 768, (256 if not quick else 64)
    pool = DeviceKVPool(lay, pool_pages, ps, "cuda")
    pool.kv_buffer.normal_()
    g = torch.Generator().manual_seed(0)
    src = torch.randperm(pool_pages, generator=g)[:n].tolist()
    dst = torch.randperm(pool_pages, generator=g)[:n].tolist()
    nbytes = n * pool.bytes_per_page
    res["page_move_pages"], res["page_move_bytes"] = n, nbytes
    flat = pool.kv_buffer.view(64, pool_pages, -1)
    # tune the kernel's block / warps on layer_first, both directions
    host = make_host_pool("layer_first", lay, pool_pages, ps)
    sid = torch.tensor(src, device="cuda")
    did = torch.tensor(dst, device="cuda")
    best, tune = None, []
    for block, warps in ((1024, 2), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16)):
        t_out = queued_time(lambda b=block, w=warps, h=host.buffer: pct.move_pages(flat, 1, sid, h, 1, did, b, w))
        t_in = queued_time(lambda b=block, w=warps, h=host.buffer: pct.move_pages(h, 1, did, flat, 1, sid, b, w))
        gbps = (nbytes / t_out + nbytes / t_in) / 2e9
        tune.append(f"{block}/{warps}: out {nbytes / t_out / 1e9:.1f} in {nbytes / t_in / 1e9:.1f}")
        if best is None or gbps > best[0]:
            best = (gbps, block, warps)
    log("page-move kernel block/warps -> GB/s: " + "; ".join(tune))
    pct.DEFAULT_BLOCK, pct.DEFAULT_WARPS = best[1], best[2]
    res["page_move_block"], res["page_move_warps"] = best[1], best[2]
    def one_layout(layout: str) -> bool:
        host = make_host_pool(layout, lay, pool_pages, ps)
        mover = PageMover(pool.kv_buffer, host)
        assert mover.use_kernel
        # correctness: out, then back into other pages
        mover.device_to_host(src, dst)
        mover.synchronize()
        good = torch.equal(host.read_pages(torch.tensor(dst[:32])), flat[:, src[:32]].cpu())
        taken = set(src)
        back = [p for p in range(pool_pages) if p not in taken]
        random.Random(1).shuffle(back)
        back = back[:n]
        mover.host_to_device(dst, back)
        good = good and torch.equal(flat[:, back], flat[:, src])

        def out():
            mover.device_to_host(src, dst)
            mover.synchronize()

        # moves queued back to back, timed by events on the model's stream like the ceiling: the
        # backup runs on the mover's stream, which the model's stream then waits for
        t_out = queued_time(lambda: mover.device_to_host(src, dst))
        t_in = queued_time(lambda: mover.host_to_device(dst, back, non_blocking=True))
        res[f"{layout}_backup_gbps"] = nbytes / t_out / 1e9
        res[f"{layout}_load_gbps"] = nbytes / t_in / 1e9
        # one call at a time (GPU idle while the host prepares each call)
        res[f"{layout}_backup_single_gbps"] = nbytes / cuda_time(lambda: mover.device_to_host(src, dst)) / 1e9
        res[f"{layout}_load_single_gbps"] = nbytes / cuda_time(
            lambda: mover.host_to_device(dst, back, non_blocking=True)) / 1e9
        # host wall time of a whole call, synchronized (Python and launch overhead included)
        res[f"{layout}_backup_wall_gbps"] = nbytes / wall_time(out) / 1e9
        res[f"{layout}_load_wall_gbps"] = nbytes / wall_time(lambda: mover.host_to_device(dst, back)) / 1e9
        # the previous path: device gather + one bulk copy + host-side scatter (fewer pages: slow)
        k = min(n, 64)
        old = PageMover(pool.kv_buffer, host, use_kernel=False)
        t_old_out = wall_time(lambda: old.device_to_host(src[:k], dst[:k]), reps=2)
        t_old_in = wall_time(lambda: old.host_to_device(dst[:k], back[:k]), reps=2)
        res[f"{layout}_staged_backup_gbps"] = k * pool.bytes_per_page / t_old_out / 1e9
        res[f"{layout}_staged_load_gbps"] = k * pool.bytes_per_page / t_old_in / 1e9
        return good

    ok = all([one_layout("layer_first"), one_layout("page_first")])
    checks["page_move_round_trip_exact"] = ok
    res["page_move_backup_gbps"] = res["layer_first_backup_gbps"]
    res["page_move_load_gbps"] = res["layer_first_load_gbps"]
    res["page_move_gbps"] = (res["page_move_backup_gbps"] + res["page_move_load_gbps"]) / 2
    res["page_move_backup_vs_d2h"] = res["page_move_backup_gbps"] / res["pinned_d2h_gbps"]
    res["page_move_load_vs_h2d"] = res["page_move_load_gbps"] / res["pinned_h2d_gbps"]
    res["page_move_vs_ceiling"] = res["page_move_gbps"] / res["copy_ceiling_gbps"]
    log(f"page moves: backup {res['page_move_backup_gbps']:.1f} GB/s, load {res['page_move_load_gbps']:.1f} GB/s "
        f"({100 * res['page_move_vs_ceiling']:.0f}% of the pinned ceiling); round trip exact: {ok}")
