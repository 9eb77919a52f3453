"""Mooncake Store through the storage tier: GB/s of batch_set / batch_get beside a plain memcpy.

    sudo .venv/bin/python bench/mooncake_store.py [--pages 256] [--json PATH]

Starts a real ``mooncake_master`` in a network namespace of its own (harness/netns.py; the
transfer engine needs a LAN address, so everything stays inside the namespace), then runs
the client in it: a ``page_first`` host pool of ``--pages`` pages is written to the store and
read back through :class:`hicache.tiers.storage.StorageTier` over
:class:`hicache.tiers.mooncake.store.MooncakeStore` (TCP transport, registered staging
buffers, values checked on read), for two page shapes: SmolLM2 in fp32 (16 tokens, 0.7 MiB)
and Llama-3.1-8B in bf16 (16 tokens, 2 MiB). Beside it: ``np.copyto`` of the same bytes (the
memory ceiling of this machine) and LMDB through the same tier. Needs root (namespaces).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, print_table, write_json  # noqa: E402

SHAPES = {"smollm2_fp32": (30, 3, 64, "float32"), "llama8b_bf16": (32, 8, 128, "bfloat16")}


def child(args) -> dict:
    import numpy as np
    import torch

    from hicache.keys import namespace_for, page_keys
    from hicache.tiers.device import KVLayout
    from hicache.tiers.host import make_host_pool
    from hicache.tiers.storage import StorageTier, make_storage

    out = {}
    for name, (layers, heads, dim, dtype) in SHAPES.items():
        lay = KVLayout(layers, heads, dim, getattr(torch, dtype))
        src = make_host_pool("page_first", lay, args.pages, 16)
        src.buffer.copy_(torch.randn(src.buffer.shape).to(src.buffer.dtype))
        dst = make_host_pool("page_first", lay, args.pages, 16)
        keys = page_keys(list(range(args.pages * 16)), 16, namespace_for(name, lay, page_size=16))
        nbytes = args.pages * src.bytes_per_page
        a, b = src.buffer.view(torch.uint8).numpy(), dst.buffer.view(torch.uint8).numpy()
        np.copyto(b, a)
        t0 = time.perf_counter()
        for _ in range(3):
            np.copyto(b, a)
        row = {"page_mib": src.bytes_per_page / 2**20, "memcpy_gbps": 3 * nbytes / (time.perf_counter() - t0) / 1e9}
        stores = {"mooncake": lambda nbytes=nbytes: make_storage("mooncake", {
                      "master_server_address": args.master, "metadata_server": args.metadata,
                      "local_hostname": args.host, "global_segment_mb": int(nbytes * 1.5) >> 20,
                      "local_buffer_mb": 64, "timeout_s": 30.0}),
                  "lmdb": lambda: make_storage("lmdb", {"path": tempfile.mkdtemp(), "capacity_gb": 8.0,
                                                        "sync": False})}
        for backend, make in stores.items():
            store = make()
            tier = StorageTier(store, lay, 16)
            dst.buffer.zero_()
            t0 = time.perf_counter()
            put = tier.batch_set(keys, src, list(range(args.pages)))
            row[f"{backend}_set_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9
            got = 0
            t0 = time.perf_counter()
            for lo in range(0, args.pages, tier.batch_pages):
                ids = list(range(lo, min(args.pages, lo + tier.batch_pages)))
                got += tier.batch_get(keys[lo:lo + len(ids)], dst, ids)
            row[f"{backend}_get_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9
            assert put == got == args.pages and torch.equal(src.buffer, dst.buffer), (backend, put, got)
            tier.close()
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--child", action="store_true", help=argparse_hidden())
    p.add_argument("--master", default="")
    p.add_argument("--metadata", default="")
    p.add_argument("--host", default="")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}
    from harness.netns import MooncakeMaster, NetNS, unavailable_reason

    why = unavailable_reason() or (None if MooncakeMaster.binary() else "mooncake_master is not installed")
    if why:
        sys.exit(f"bench/mooncake_store.py: {why}")
    with NetNS("hcb") as ns, tempfile.TemporaryDirectory() as d:
        master = MooncakeMaster(ns, Path(d) / "master.log")
        master.start()
        try:
            proc = ns.popen([sys.executable, os.path.abspath(__file__), "--child", "--pages", str(args.pages),
                             "--master", master.address, "--metadata", master.metadata_url, "--host", ns.address],
                            stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(__file__)) or ".")
            stdout, _ = proc.communicate(timeout=600)
        finally:
            master.stop()
    if proc.returncode != 0:
        sys.exit(f"the client failed (exit {proc.returncode})")
    res = json.loads(stdout.strip().splitlines()[-1])
    rows = [[name, r["page_mib"], r["memcpy_gbps"], r["mooncake_set_gbps"], r["mooncake_get_gbps"],
             r["lmdb_set_gbps"], r["lmdb_get_gbps"]] for name, r in res.items()]
    print_table(["page shape", "page MiB", "memcpy GB/s", "mooncake set", "mooncake get", "lmdb set", "lmdb get"],
                rows)
    data = {"pages": args.pages, "transport": "tcp (network namespace, veth)", "date": time.strftime("%Y-%m-%d"),
            "shapes": res}
    write_json(args.json, data)
    return data


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
