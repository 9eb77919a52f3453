"""Multi-turn chat against the real engine: how much prefill the cache tiers save.

Many users, several turns each; every turn resends the whole conversation. The KV
working set is sized to be several times L1, so returning turns only hit if the
lower tiers keep their prefixes. Prints TTFT p50/p90 of returning turns, hit tokens
per tier and throughput, per tier setup, in one run; ``--json`` and ``--png``.

    .venv/bin/python bench/multiturn.py [--users 8 --turns 4] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, print_table, write_json  # noqa: E402

SETUPS: dict[str, dict[str, Any]] = {
    "L1": {},
    "L1+L2": {"hicache_ratio": 2.0, "hicache_write_policy": "write_through"},
    "L1+L2+L3": {"hicache_ratio": 2.0, "hicache_write_policy": "write_through",
                 "hicache_storage_backend": "lmdb", "hicache_storage_prefetch_policy": "wait_complete",
                 "hicache_storage_prefetch_threshold": 32},
}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_setup(name: str, extra: dict[str, Any], args, system: list[int], turns: list[list[list[int]]],
              inspect=None) -> dict:  # noqa: ANN001 - inspect(core, last_prompts) -> dict, before shutdown
    from serving.engine import Engine

    if extra.get("hicache_storage_backend") == "lmdb":
        import tempfile

        path = tempfile.mkdtemp(prefix="hicache-bench-l3-")
        l3 = {"path": path, "capacity_gb": 8.0, **extra.get("hicache_storage_backend_extra_config", {})}
        extra = {**extra, "hicache_storage_backend_extra_config": l3}
    eng = Engine(model_path=args.model_path, max_total_tokens=args.l1_tokens, page_size=args.page_size,
                 device=args.device, **extra)
    core = eng.core
    convo = [list(system) for _ in range(args.users)]
    ttft: list[float] = []
    hits = {"device": 0, "host": 0, "storage": 0}
    prompt_tokens = 0
    out_tokens = 0
    t_start = time.perf_counter()
    for t in range(args.turns):
        reqs = []
        for u in range(args.users):
            convo[u] += turns[u][t]
            reqs.append(core.make_request(input_ids=list(convo[u]), sampling_params={
                "temperature": 0, "max_new_tokens": args.output_tokens, "ignore_eos": True}))
        # at most `concurrency` users in flight; the next user's turn starts when one finishes
        pending = list(reqs)
        while pending or core.scheduler.has_work:
            while pending and len(core.scheduler.running) + len(core.scheduler.waiting) < args.concurrency:
                r = pending.pop(0)
                r.created = time.monotonic()
                core.add(r)
            before = core.scheduler.stats.forward_passes
            core.step()
            if core.scheduler.stats.forward_passes == before:
                time.sleep(0.0005)  # waiting on a copy or the store: leave those threads the GIL
        for u, r in enumerate(reqs):
            convo[u] += r.output_ids
            out_tokens += len(r.output_ids)
            if t > 0:
                ttft.append(r.first_token_time - r.created)
                prompt_tokens += len(r.input_ids)
                for k, v in r.kv.cached_by_tier.items():
                    hits[k] += v
    elapsed = time.perf_counter() - t_start
    if core.storage is not None:
        core.storage.poll(wait=True)
    core.check_integrity()
    more = inspect(core, [r.input_ids for r in reqs]) if inspect is not None else {}
    eng.shutdown()
    return {**more,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
        "hit_tokens_device": hits["device"], "hit_tokens_host": hits["host"], "hit_tokens_storage": hits["storage"],
        "returning_prompt_tokens": prompt_tokens,
        "hit_rate": sum(hits.values()) / max(1, prompt_tokens),
        "output_tok_s": out_tokens / elapsed, "elapsed_s": elapsed,
    }


def make_workload(args) -> tuple[list[int], list[list[list[int]]]]:  # noqa: ANN001
    """A shared system prompt and each user's turns (random token ids, seed 0)."""
    from serving.models.arch_config import ModelArchConfig

    vocab = ModelArchConfig.from_pretrained(args.model_path).vocab_size
    rng = random.Random(0)
    system = [rng.randrange(100, vocab - 100) for _ in range(args.system_tokens)]
    turns = [[[rng.randrange(100, vocab - 100) for _ in range(args.user_tokens)] for _ in range(args.turns)]
             for _ in range(args.users)]
    return system, turns


def plot(results: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar([n + " p50" for n in names], [results[n]["ttft_p50_s"] for n in names], color="tab:blue")
    a.bar([n + " p90" for n in names], [results[n]["ttft_p90_s"] for n in names], color="tab:orange")
    a.set_ylabel("TTFT of returning turns (s)")
    bottom = [0.0] * len(names)
    for tier, color in (("device", "tab:green"), ("host", "tab:purple"), ("storage", "tab:gray")):
        vals = [results[n][f"hit_tokens_{tier}"] for n in names]
        b.bar(names, vals, bottom=bottom, label=tier, color=color)
        bottom = [x + y for x, y in zip(bottom, vals, strict=True)]
    b.set_ylabel("prompt tokens served from cache")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model-path", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=192)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--l1-tokens", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=2, help="users in flight at once")
    p.add_argument("--device", default="auto")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma list of {list(SETUPS)}")
    p.add_argument("--png", metavar="PATH", help="also write a plot")
    p.add_argument("--kv-encodings", metavar="LIST",
                   help="compare L2/L3 encodings (e.g. raw,fp8,int8) in the same L2/L3 bytes instead of tier setups "
                        "(bench/multiturn_kv.py: pages and conversations held, hit rate, TTFT, top-1 agreement)")
    p.add_argument("--l2-mb", type=float, default=16.0, help="with --kv-encodings: L2 bytes (MiB)")
    p.add_argument("--l3-mb", type=float, default=48.0, help="with --kv-encodings: L3 (LMDB) capacity (MiB)")
    args = p.parse_args(argv)
    if args.kv_encodings:
        from bench.multiturn_kv import compare_encodings

        return compare_encodings(args, make_workload(args), run_setup)
    system, turns = make_workload(args)
    working_set = args.users * (args.system_tokens + args.turns * (args.user_tokens + args.output_tokens))
    print(f"KV working set {working_set} tokens = {working_set / args.l1_tokens:.1f}x L1 ({args.l1_tokens})")
    results = {name: run_setup(name, SETUPS[name], args, system, turns) for name in args.setups.split(",")}
    print_table(["tiers", "TTFT p50 (s)", "TTFT p90 (s)", "hit L1", "hit L2", "hit L3", "hit rate", "out tok/s"],
                [[n, r["ttft_p50_s"], r["ttft_p90_s"], r["hit_tokens_device"], r["hit_tokens_host"],
                  r["hit_tokens_storage"], r["hit_rate"], r["output_tok_s"]] for n, r in results.items()])
    data = {"working_set_tokens": working_set, "l1_tokens": args.l1_tokens, "setups": results}
    write_json(args.json, data)
    if args.png:
        plot(results, args.png)
    return data


if __name__ == "__main__":
    main()
