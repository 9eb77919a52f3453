"""Why a returning turn of Qwen3.5 (9B shape) is not faster from L1 than recomputed (bench/hybrid.py's
first H200 run: 0.377 s vs 0.336 s for 8k tokens). Times each L1 hit in a row (the first ones pay
kernel compiles: a steady state shows in the later ones) beside fresh prompts of the same length, and
profiles one steady hit: the top CUDA and CPU ops by total time.

    python3 bench/hybrid_hit_probe.py [--json PATH] [--hits 5] [--ctx 8192] [--small --device cpu]
        [--l2-gb 8 [--l3]]

``--l2-gb`` gives the engine an L2 of that size (write-through: a first hit backs its node up) and ``--l3``
an LMDB L3 behind it, as bench/hybrid.py's TTFT section has; one more steady hit then runs under cProfile
(the scheduler's Python: ``top_python``, cumulative seconds).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402
from bench.gpu_model import rand_prompts  # noqa: E402
from bench.gpu_tiers_sections import ONE, close, make_engine, timed  # noqa: E402
from bench.hybrid_shapes import qwen3_5_config, write_model_dir  # noqa: E402


def top_ops(prof, key: str, n: int = 12) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"op": e.key[:80], "calls": e.count, "total_ms": round(getattr(e, key) / 1e3, 3)} for e in rows]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--hits", type=int, default=5)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--small", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--l2-gb", type=float, default=0.0)
    p.add_argument("--l3", action="store_true")
    args = p.parse_args()
    args.engine_init_s, args.read_threads, args.l3_gb = [], 4, 1.0
    cfg = qwen3_5_config(args.small)
    work = tempfile.mkdtemp(prefix="hit-probe-")
    model_dir = write_model_dir(os.path.join(work, "qwen3_5"), cfg)
    ctx, vocab, n = args.ctx, cfg["vocab_size"], args.hits
    tiers = {"hicache_size": args.l2_gb} if args.l2_gb else {}
    l3 = os.path.join(work, "l3") if args.l3 and args.l2_gb else None
    eng = make_engine(args, model_dir, l3, max_total_tokens=(2 * n + 6) * (ctx + 64), **tiers)
    res: dict = {"ctx": ctx, "hits": n, "device": args.device,
                 "state_backend": os.environ.get("HICACHE_STATE_BACKEND", "auto")}
    for q in rand_prompts(2, 1024, vocab, seed=1):
        eng.generate(input_ids=q, sampling_params=ONE)
    res["recompute_s"] = [round(timed(eng, q)[0], 4) for q in rand_prompts(3, ctx, vocab, seed=2)]
    firsts, mores = rand_prompts(n + 2, ctx - 64, vocab, seed=3), rand_prompts(n + 2, 63, vocab, seed=4)
    hits, cached = [], []
    for i in range(n + 2):
        ret = firsts[i] + eng.generate(input_ids=firsts[i], sampling_params=ONE)["output_ids"] + mores[i]
        if i == n:
            py = cProfile.Profile()
            py.enable()
            dt, _ = timed(eng, ret)
            py.disable()
            res["cprofiled_hit_s"] = round(dt, 4)
            st = pstats.Stats(py)
            rows = sorted(st.stats.items(), key=lambda kv: kv[1][3], reverse=True)[:30]
            res["top_python"] = [{"fn": f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}", "calls": v[1],
                                  "cum_s": round(v[3], 4), "own_s": round(v[2], 4)} for k, v in rows]
            continue
        if i == n + 1:
            break
        dt, out = timed(eng, ret)
        hits.append(round(dt, 4))
        cached.append(out["meta_info"]["cached_tokens"])
    res["l1_hit_s"], res["l1_cached_tokens"] = hits, cached
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                    if args.device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        dt, out = timed(eng, ret)
    res["profiled_hit_s"] = round(dt, 4)
    res["profiled_wall_s"] = round(time.perf_counter() - t0, 4)
    res["top_cpu"] = top_ops(prof, "cpu_time_total")
    if args.device == "cuda":
        res["top_cuda"] = top_ops(prof, "device_time_total")
    close(eng)
    width = max(len(hits), 3)
    rows = [[name, *vals, *[""] * (width - len(vals))] for name, vals in
            (("recompute (s)", res["recompute_s"]), ("L1 hits (s)", hits), ("cached tokens", cached))]
    print_table(["what", *[str(i) for i in range(width)]], rows)
    for name in ("top_cuda", "top_cpu"):
        for r in res.get(name, []):
            print(f"{name} {r['total_ms']:>10.3f} ms {r['calls']:>6} {r['op']}")
    for r in res.get("top_python", []):
        print(f"top_python {r['cum_s']:>8.4f} s cum {r['own_s']:>8.4f} s own {r['calls']:>7} {r['fn']}")
    write_json(args.json, res)


if __name__ == "__main__":
    main()
