"""Trace replay, the field's methodology: the Mooncake trace (../shared/traces/) through HiCache.

**policy** (CPU, no model): the whole trace (or a slice) through the real HiRadixTree
bookkeeping, driven as the engine drives it (bench/trace_policy.py), for each tier setup given
as ``L1[+L2[+L3]]`` token capacities (``--setups 1M,1M+4M,1M+4M+11M``). Per setup: prompt tokens
hit per tier, the hit rate against an LRU of 512-token blocks with the same total capacity (the
bound, computed from the hash ids; bench/trace_data.py), and against the bound at the largest
tier's capacity and at the tree's *distinct* capacity (tokens held on some tier at the end):
the tiers are inclusive (a page hit on L1 has a copy on L2, every L2 page is written on to L3),
so the total counts those copies twice; and the bookkeeping microseconds per request (the tree
alone; the L3 model's own time apart).

    .venv/bin/python bench/trace_replay.py policy [--setups 1M,4M,16M,1M+4M,1M+4M+11M] [--json out.json]

**live**: a slice against ``hicache serve`` over HTTP (bench/trace_live.py): ``--url`` of a
running server, or ``--serve`` to start one per setup (``L1``, ``L1+L2``, ``L1+L2+L3``; the
common flags in ``--server-args``), one row each: TTFT p50/p90, prompt throughput, tokens hit
per tier, write-backs dropped, and the hit rate the policy replay predicts for that slice with
that server's capacities.

    .venv/bin/python bench/trace_replay.py live --serve --setups L1,L1+L2+L3 --busiest 20 \\
        --server-args "--model-path M --max-total-tokens 100000" --l2-ratio 3 --l3-gb 30 --json out.json
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, print_table, write_json  # noqa: E402
from bench.trace_data import DEFAULT_TRACE, BlockTokens, load_trace, lru_block_bound, select  # noqa: E402
from bench.trace_policy import PolicyConfig, PolicyReplay, distinct_tokens  # noqa: E402

_UNITS = {"k": 1_000, "K": 1_000, "M": 1_000_000, "G": 1_000_000_000}


def tokens_arg(s: str) -> int:
    """``1M`` -> 1_000_000, ``512k``, ``4096``."""
    s = s.strip()
    mult = _UNITS.get(s[-1:], 1)
    try:
        return int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise ValueError(f"not a token count: {s!r} (e.g. 4096, 512k, 1M)") from None


def parse_setup(s: str) -> tuple[int, int, int]:
    parts = [tokens_arg(p) for p in s.split("+")]
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"a setup is L1[+L2[+L3]] token capacities, got {s!r}")
    return (*parts, *([0] * (3 - len(parts))))  # type: ignore[return-value]


# ---------------------------------------------------------------------------------- policy
def policy_setup(reqs, blocks: BlockTokens, l1: int, l2: int, l3: int, args) -> dict[str, Any]:  # noqa: ANN001
    cfg = PolicyConfig(l1, l2, l3, args.page_size, args.write_policy, "lru", args.prefetch_threshold,
                       args.concurrency, 1, write_through_threshold=args.write_through_threshold,
                       chunked_prefill_size=args.chunked_prefill_size, schedule_policy=args.schedule_policy,
                       overlap_schedule=args.overlap_schedule)
    rep = PolicyReplay(cfg)
    rep.run((blocks.tokens(r), [0]) for r in reqs)
    out = rep.summary()
    bound = lru_block_bound(reqs, cfg.total_tokens, blocks)["hit_rate"]
    largest = lru_block_bound(reqs, max(l1, l2, l3), blocks)["hit_rate"]
    held = distinct_tokens(rep)
    held_bound = lru_block_bound(reqs, held, blocks)["hit_rate"]
    out.update(l1_tokens=l1, l2_tokens=l2, l3_tokens=l3, total_tokens=cfg.total_tokens, lru_bound=bound,
               vs_bound=_ratio(out["hit_rate"], bound), lru_bound_at_largest=largest,
               vs_bound_at_largest=_ratio(out["hit_rate"], largest), distinct_tokens=held,
               lru_bound_at_distinct=held_bound, vs_bound_at_distinct=_ratio(out["hit_rate"], held_bound))
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def run_policy(args) -> dict[str, Any]:  # noqa: ANN001
    reqs = select(load_trace(args.trace), args.start, args.count, args.busiest)
    blocks = BlockTokens(args.block_tokens)
    results = {}
    for name in args.setups.split(","):
        t0 = time.perf_counter()
        results[name] = policy_setup(reqs, blocks, *parse_setup(name), args)
        results[name]["wall_s"] = time.perf_counter() - t0
        print(f"{name}: {results[name]['hit_rate']:.3f} ({results[name]['wall_s']:.0f} s)", file=sys.stderr)
    print(f"{len(reqs)} requests, {sum(blocks.length(r) for r in reqs)} prompt tokens, page size {args.page_size}, "
          f"{args.write_policy}, concurrency {args.concurrency}")
    print_table(["L1+L2+L3", "hit L1", "hit L2", "hit L3", "hit rate", "LRU bound", "x bound", "x bound@largest",
                 "distinct", "x bound@distinct", "us/req"],
                [[n, r["hit_tokens_device"], r["hit_tokens_host"], r["hit_tokens_storage"], r["hit_rate"],
                  r["lru_bound"], r["vs_bound"], r["vs_bound_at_largest"], r["distinct_tokens"],
                  r["vs_bound_at_distinct"], r["bookkeeping_us_per_request"]] for n, r in results.items()])
    return {"mode": "policy", "trace": str(args.trace), "requests": len(reqs), "page_size": args.page_size,
            "block_tokens": args.block_tokens, "write_policy": args.write_policy,
            "write_through_threshold": args.write_through_threshold, "concurrency": args.concurrency,
            "slice": {"start": args.start, "count": args.count, "busiest": args.busiest}, "setups": results}


# ---------------------------------------------------------------------------------- live
LIVE_SETUPS: dict[str, list[str]] = {
    "L1": [],
    "L1+L2": ["--hicache-mem-layout", "page_first"],
    "L1+L2+L3": ["--hicache-mem-layout", "page_first", "--hicache-storage-backend", "lmdb",
                 "--hicache-storage-prefetch-policy", "wait_complete",
                 "--hicache-storage-prefetch-timeout-base", "300"],
}


def server_argv(name: str, args, workdir: Path) -> list[str]:  # noqa: ANN001
    """The flags of setup ``name``: its own, then ``--server-args`` (which win), an L2 of
    ``--l2-ratio`` x L1 and, for L3, a config file naming a fresh LMDB directory."""
    if name not in LIVE_SETUPS:
        raise ValueError(f"unknown live setup {name!r}; choose from {sorted(LIVE_SETUPS)}")
    argv = list(LIVE_SETUPS[name])
    if "L2" in name:
        argv += ["--hicache-ratio", str(args.l2_ratio)]
    if "L3" in name:
        if args.l3_dir:
            os.makedirs(args.l3_dir, exist_ok=True)
        l3 = Path(tempfile.mkdtemp(prefix="trace-l3-", dir=args.l3_dir))
        cfg = workdir / f"{name.replace('+', '_')}.yaml"
        cfg.write_text(f"cache:\n  hicache_storage_backend_extra_config:\n    path: {l3}\n"
                       f"    capacity_gb: {args.l3_gb}\n")
        argv = ["--config", str(cfg), *argv]
    return argv + shlex.split(args.server_args) + shlex.split(args.setup_args.get(name, ""))


def run_live_cli(args) -> dict[str, Any]:  # noqa: ANN001
    from bench.trace_live import run_live

    reqs = select(load_trace(args.trace), args.start, args.count, args.busiest)
    blocks = BlockTokens(args.block_tokens)
    kw = dict(concurrency=args.concurrency, max_new_tokens=args.max_new_tokens, speedup=args.speedup,
              settle=args.settle)
    results: dict[str, Any] = {}
    if args.url:
        results["server"] = run_live(args.url, reqs, blocks, **kw)
    else:
        from harness.server_utils import ServerProcess

        with tempfile.TemporaryDirectory(prefix="trace-replay-") as work:
            for name in args.setups.split(","):
                server = ServerProcess(server_argv(name, args, Path(work)))
                server.start(timeout=args.start_timeout)
                try:
                    results[name] = run_live(server.url, reqs, blocks, **kw)
                    results[name]["integrity_ok"] = server.check_integrity()["ok"]
                    print(f"{name}: {results[name]}", flush=True)
                    write_json(args.json, {**results, "partial": True})  # kept if a later setup fails
                finally:  # a server with L3 persists its cache before it exits: give it the time
                    results.setdefault(name, {})["exit_code"] = server.stop(timeout=args.start_timeout)
    rows = []
    for name, r in results.items():
        m, p = r["measured"], r["predicted"]
        rows.append([name, m["requests"], m["errors"], m["ttft_p50_s"], m["ttft_p90_s"], m["prompt_tok_s"],
                     m["hit_tokens_device"], m["hit_tokens_host"], m["hit_tokens_storage"], m["hit_rate"],
                     p["hit_rate"], r["hit_rate_vs_predicted"], m.get("write_pages_dropped", "-")])
    print(f"{len(reqs)} requests, concurrency {args.concurrency}, max_new_tokens {args.max_new_tokens}, "
          f"speedup {args.speedup or 'none (closed loop)'}{', settled L3 writes' if args.settle else ''}")
    print_table(["setup", "reqs", "errors", "TTFT p50", "TTFT p90", "prompt tok/s", "hit L1", "hit L2", "hit L3",
                 "hit rate", "predicted", "x predicted", "wb dropped"], rows)
    names = list(results)
    data: dict[str, Any] = {"mode": "live", "trace": str(args.trace), "requests": len(reqs),
                            "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens,
                            "speedup": args.speedup, "settle": args.settle, "block_tokens": args.block_tokens,
                            "slice": {"start": args.start, "count": args.count, "busiest": args.busiest},
                            "setups": results}
    if len(names) >= 2:  # the last setup against the first (L1+L2+L3 against L1)
        a, b = results[names[0]]["measured"], results[names[-1]]["measured"]
        data["ttft_p50_speedup"] = a["ttft_p50_s"] / b["ttft_p50_s"] if a["ttft_p50_s"] and b["ttft_p50_s"] else None
        data["throughput_speedup"] = b["prompt_tok_s"] / a["prompt_tok_s"] if a["prompt_tok_s"] else None
        print(f"{names[-1]} vs {names[0]}: TTFT p50 {data['ttft_p50_speedup']}x, "
              f"throughput {data['throughput_speedup']}x")
    return data


def run_predict(args) -> dict[str, Any]:  # noqa: ANN001
    """The policy replay's prediction, now, for each setup of a committed live run (its slice and the
    servers' capacities as recorded; ``--overlap-schedule`` for a CUDA server's)."""
    from bench.trace_live import ServerCaps, predict

    live = json.loads(Path(args.live_json).read_text())
    sl = live["slice"]
    reqs = select(load_trace(args.trace), sl["start"], sl["count"], sl["busiest"])
    blocks = BlockTokens(live["block_tokens"])
    results: dict[str, Any] = {}
    for name, r in live["setups"].items():
        overlap = args.overlap_schedule or r["caps"].get("overlap_schedule", False)
        caps = ServerCaps(**{**r["caps"], "overlap_schedule": overlap})
        p = predict(caps, reqs, blocks, live["concurrency"], live["max_new_tokens"])
        m = r["measured"]
        results[name] = {"caps": caps.__dict__, "measured_hit_rate": m["hit_rate"], "predicted": p,
                         "hit_rate_vs_predicted": _ratio(m["hit_rate"], p["hit_rate"]),
                         "recorded_prediction": r["predicted"]["hit_rate"]}
    print(f"{args.live_json}: {len(reqs)} requests, concurrency {live['concurrency']}")
    tiers = ("device", "host", "storage")
    print_table(["setup", "measured", "predicted", "x predicted", "L1 / L2 / L3 measured", "L1 / L2 / L3 predicted",
                 "recorded prediction"],
                [[n, v["measured_hit_rate"], v["predicted"]["hit_rate"], v["hit_rate_vs_predicted"],
                  "/".join(str(live["setups"][n]["measured"][f"hit_tokens_{t}"]) for t in tiers),
                  "/".join(str(v["predicted"][f"hit_tokens_{t}"]) for t in tiers),
                  v["recorded_prediction"]] for n, v in results.items()])
    return {"mode": "predict", "live_json": str(args.live_json), "setups": results}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("mode", choices=("policy", "live", "predict"))
    p.add_argument("--live-json", help="predict: a live run's JSON (its slice and server capacities)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--start", type=int, default=0, help="first request of the slice")
    p.add_argument("--count", type=int, default=None, help="requests in the slice (default: all)")
    p.add_argument("--busiest", type=int, default=0, help="only the requests of the N busiest conversation chains")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id (< 512 shrinks every prompt)")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (policy 1, live 8)")
    p.add_argument("--setups", default=None,
                   help="policy: L1[+L2[+L3]] capacities (1M,1M+4M,...); live: names from " + ",".join(LIVE_SETUPS))
    p.add_argument("--page-size", type=int, default=16, help="policy")
    p.add_argument("--write-policy", default="write_through", help="policy")
    p.add_argument("--prefetch-threshold", type=int, default=256, help="policy: tokens")
    p.add_argument("--chunked-prefill-size", type=int, default=2048,
                   help="policy: the server's prompt tokens per pass (-1: no limit)")
    p.add_argument("--schedule-policy", default="lpm", help="policy: the server's admission order (lpm, fcfs)")
    p.add_argument("--overlap-schedule", action="store_true",
                   help="policy: a pass's results resolved after the next pass is planned (a CUDA server's default)")
    p.add_argument("--write-through-threshold", type=int, default=2,
                   help="policy: hits that make a node hot (write_through_selective; exclusive: keeps its copies)")
    p.add_argument("--url", help="live: a running server (instead of --serve)")
    p.add_argument("--serve", action="store_true", help="live: start a server per setup")
    p.add_argument("--server-args", default="", help="live: flags for every started server")
    p.add_argument("--setup-args", action="append", default=[], metavar="NAME=FLAGS",
                   help="live: more flags for one setup (repeatable)")
    p.add_argument("--l2-ratio", type=float, default=2.0, help="live: L2 size as a multiple of L1")
    p.add_argument("--l3-gb", type=float, default=8.0, help="live: LMDB capacity")
    p.add_argument("--l3-dir", default=None, help="live: where the LMDB directories go (default: the temp dir)")
    p.add_argument("--max-new-tokens", type=int, default=1, help="live: cap on each request's output length")
    p.add_argument("--speedup", type=float, default=0.0,
                   help="live: send at timestamp / speedup (0: as fast as the concurrency allows)")
    p.add_argument("--settle", action="store_true",
                   help="live: start each request once the server's L3 writes are done (the policy's assumption)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="live: seconds a started server may take")
    args = p.parse_args(argv)
    setup_args = {}
    for item in args.setup_args:
        name, sep, flags = item.partition("=")
        if not sep:
            p.error(f"--setup-args takes NAME=FLAGS, got {item!r}")
        setup_args[name] = flags
    args.setup_args = setup_args
    if args.mode == "predict":
        if not args.live_json:
            p.error("predict needs --live-json")
        data = run_predict(args)
    elif args.mode == "policy":
        args.concurrency = args.concurrency or 1
        args.setups = args.setups or "1M,4M,16M,1M+4M,1M+4M+11M"
        data = run_policy(args)
    else:
        if bool(args.url) == bool(args.serve):
            p.error("live needs exactly one of --url and --serve")
        args.concurrency = args.concurrency or 8
        args.setups = args.setups or "L1,L1+L2+L3"
        data = run_live_cli(args)
    write_json(args.json, data)
    return data


if __name__ == "__main__":
    main()
