"""Page-copy throughput between the L1 pool and the L2 host pool, beside a plain
contiguous copy of the same bytes (the ceiling a page move can approach).

    .venv/bin/python bench/page_copy.py [--pages 512] [--json out.json]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402
from hicache.tiers.device import DeviceKVPool, KVLayout  # noqa: E402
from hicache.tiers.host import make_host_pool  # noqa: E402
from serving.kernels.page_copy import PageMover  # noqa: E402


def timed(fn, reps: int, sync) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=512, help="pages moved per call")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    lay = KVLayout(args.layers, args.kv_heads, args.head_dim, torch.float32 if dev.type == "cpu" else torch.bfloat16)
    pool = DeviceKVPool(lay, args.pages * 2, args.page_size, dev)
    g = torch.Generator().manual_seed(0)
    dev_pages = torch.randperm(args.pages * 2, generator=g)[: args.pages].tolist()
    host_pages = torch.randperm(args.pages * 2, generator=g)[: args.pages].tolist()
    nbytes = pool.bytes_per_page * args.pages
    rows, res = [], {"pages": args.pages, "bytes_per_call": nbytes, "device": args.device}
    src = torch.empty(nbytes // lay.dtype.itemsize, dtype=lay.dtype, device=dev)
    dst = torch.empty(src.shape, dtype=lay.dtype, pin_memory=dev.type == "cuda")
    t = timed(lambda: dst.copy_(src), args.reps, sync)
    res["contiguous_copy_gbps"] = nbytes / t / 1e9
    rows.append(["contiguous copy (same bytes)", nbytes / t / 1e9])
    for layout in ("layer_first", "page_first"):
        host = make_host_pool(layout, lay, args.pages * 2, args.page_size)
        mover = PageMover(pool.kv_buffer, host)
        t_out = timed(lambda m=mover: m.device_to_host(dev_pages, host_pages), args.reps, sync)
        t_in = timed(lambda m=mover: m.host_to_device(host_pages, dev_pages), args.reps, sync)
        res[f"{layout}_backup_gbps"] = nbytes / t_out / 1e9
        res[f"{layout}_load_gbps"] = nbytes / t_in / 1e9
        rows.append([f"L1->L2 backup, {layout}", nbytes / t_out / 1e9])
        rows.append([f"L2->L1 load, {layout}", nbytes / t_in / 1e9])
    print(f"{args.pages} scattered pages of {pool.bytes_per_page} bytes per call ({nbytes / 2**20:.1f} MiB)")
    print_table(["copy", "GB/s"], rows)
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
