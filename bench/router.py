"""Router benchmark: routing-decision latency and the proxy's added latency.

1. Decision latency (in process, no servers): the cache_aware policy over 16 workers whose
   approximate trees hold ~1M tokens each (groups of long shared system prompts + unique
   suffixes); p50 / p99 of ``select`` alone, of ``select`` + remembering the request (insert),
   and of building the routing key from token ids. Also the exact view (``cache_view: events``):
   page keys of the prompt + lookups in 16 workers' page sets of ~1M tokens each.
2. Proxy overhead: sequential one-token /generate requests to one real tiny worker, direct and
   through a router (in process, on its own thread); the difference of the medians is what
   the router adds per request. ``--no-servers`` skips it.
3. Fleet scale (bench/router_fleet.py): 64 workers x 1M announced pages, 10k sessions, the
   router's memory under its caps and the decision p99 (goal: <= 1 ms); cached share with and
   without shared-L3 credit. ``--no-fleet`` skips it.

``python -m bench.router [--json PATH] [--workers 16] [--tree-tokens 1000000]``
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import parser, print_table, write_json  # noqa: E402
from bench.router_fleet import add_args, fleet_bench, share_bench  # noqa: E402
from hicache.keys import page_keys  # noqa: E402
from router.approx_tree import token_key  # noqa: E402
from router.cache_view import L1, CacheView, WorkerCache  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.policies import RouteRequest, make_policy  # noqa: E402
from router.workers import Worker  # noqa: E402

VOCAB = 49152
PS = 16
NS = "bench|ns"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def build(n_workers: int, tree_tokens: int, prefix_len: int, suffix_len: int, rng: random.Random) -> tuple:
    prompts = [[rng.randrange(VOCAB) for _ in range(prefix_len)] for _ in range(4 * n_workers)]
    policy = make_policy(RouterConfig(max_tree_size=2 * tree_tokens))
    workers = [Worker(f"http://node{i // 8}:{30000 + i % 8}") for i in range(n_workers)]
    caches = {w.url: WorkerCache(epoch="e", namespace=NS, page_size=PS) for w in workers}
    for i, w in enumerate(workers):
        mine = prompts[4 * i : 4 * i + 4]
        while policy.tree.sizes.get(w.url, 0) < tree_tokens:
            ids = rng.choice(mine) + [rng.randrange(VOCAB) for _ in range(suffix_len)]
            policy.on_sent(RouteRequest(token_key(ids), ids), w)
            for k in page_keys(ids, PS, NS):
                caches[w.url].pages[k] = L1
    view = CacheView(None, {}, 1.0)  # type: ignore[arg-type]
    view.caches = caches
    return prompts, policy, workers, view


def decision_bench(args: Any) -> list[dict[str, Any]]:
    rng = random.Random(0)
    t0 = time.perf_counter()
    prompts, policy, workers, view = build(args.workers, args.tree_tokens, args.prefix_len, args.suffix_len, rng)
    build_s = time.perf_counter() - t0
    sizes = policy.tree.sizes
    print(
        f"built {len(workers)} trees in {build_s:.1f} s: {min(sizes.values())}-{max(sizes.values())} tokens each, "
        f"{policy.tree.num_nodes()} nodes"
    )
    queries = []
    for _ in range(args.queries):
        ids = rng.choice(prompts) + [rng.randrange(VOCAB) for _ in range(args.suffix_len)]
        queries.append(ids)
    rows = []
    key_t, sel_t, both_t, exact_t = [], [], [], []
    for ids in queries:
        for w in workers:
            w.polled_load = rng.randrange(4)  # balanced: the tree decides
        t = time.perf_counter_ns()
        req = RouteRequest(token_key(ids), ids)
        t1 = time.perf_counter_ns()
        w = policy.select(req, workers)
        t2 = time.perf_counter_ns()
        policy.on_sent(req, w)
        t3 = time.perf_counter_ns()
        view.best(ids, {x.url: x for x in workers}, 0.3)
        t4 = time.perf_counter_ns()
        key_t.append((t1 - t) / 1e3)
        sel_t.append((t2 - t1) / 1e3)
        both_t.append((t3 - t1) / 1e3)
        exact_t.append((t4 - t3) / 1e3)
    for name, xs in (
        ("routing key from ids", key_t),
        ("select (cache_aware)", sel_t),
        ("select + insert", both_t),
        ("exact view: keys + lookups", exact_t),
    ):
        rows.append({"what": name, "p50_us": pct(xs, 0.5), "p99_us": pct(xs, 0.99), "max_us": max(xs)})
    return rows


def proxy_bench(args: Any) -> list[dict[str, Any]]:
    import httpx

    from harness.model_utils import tiny_model
    from harness.server_utils import ServerProcess
    from router.embedded import RouterThread

    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    model = tiny_model(tmp / "tiny", with_tokenizer=True, max_position_embeddings=512)
    worker = ServerProcess(["--model-path", str(model)])
    worker.start()
    rows = []
    try:
        with RouterThread(RouterConfig(worker_urls=(worker.url,))) as router:
            body = {"text": "The router benchmark says hello", "sampling_params": {"max_new_tokens": 1}}
            with httpx.Client(timeout=30) as c:
                times: dict[str, list[float]] = {"direct": [], "via router": []}
                for i in range(args.requests * 2 + 20):
                    name = "direct" if i % 2 == 0 else "via router"
                    url = worker.url if name == "direct" else router.url
                    t = time.perf_counter()
                    r = c.post(url + "/generate", json=body)
                    dt = (time.perf_counter() - t) * 1e3
                    assert r.status_code == 200, r.text
                    if i >= 20:  # warm-up
                        times[name].append(dt)
        for name, xs in times.items():
            rows.append({"path": name, "p50_ms": pct(xs, 0.5), "p99_ms": pct(xs, 0.99), "mean_ms": statistics.mean(xs)})
        rows.append(
            {
                "path": "added by router",
                "p50_ms": rows[1]["p50_ms"] - rows[0]["p50_ms"],
                "p99_ms": rows[1]["p99_ms"] - rows[0]["p99_ms"],
                "mean_ms": rows[1]["mean_ms"] - rows[0]["mean_ms"],
            }
        )
    finally:
        worker.stop()
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--tree-tokens", type=int, default=1_000_000)
    p.add_argument("--prefix-len", type=int, default=1500)
    p.add_argument("--suffix-len", type=int, default=400)
    p.add_argument("--queries", type=int, default=3000)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--no-servers", action="store_true")
    add_args(p)
    args = p.parse_args()
    out: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json"}}
    rows = decision_bench(args)
    print_table(["what", "p50 us", "p99 us", "max us"], [list(r.values()) for r in rows])
    out["decision"] = rows
    if not args.no_servers:
        prow = proxy_bench(args)
        print()
        print_table(
            ["path (1-token /generate, tiny model)", "p50 ms", "p99 ms", "mean ms"], [list(r.values()) for r in prow]
        )
        out["proxy"] = prow
    if not args.no_fleet:
        fleet = fleet_bench(args)
        print()
        print_table(["fleet scale", "value"], [[k, v] for k, v in fleet.items()])
        out["fleet"] = fleet
        share = share_bench(args)
        print()
        print_table(["routing", "local share", "shared L3 share", "cached share", "busiest / mean", "decisions"],
                    [list(r.values()) for r in share])
        out["cached_share"] = share
    write_json(args.json, out)


if __name__ == "__main__":
    main()
