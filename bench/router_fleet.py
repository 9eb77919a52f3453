"""Router at fleet scale (part of ``bench/router.py``; in process, no servers).

64 simulated workers whose cache events announce ~1M pages each, 10k sessions from several
tenants, and the router's structures bounded by their caps (``max_worker_pages`` page keys per
worker in the exact view, ``max_tree_size`` tokens per worker in the approximate tree,
``max_sessions`` affinity entries): the router process's memory (RSS) after the build, the
structures' sizes and what each cap dropped, then the decision path of a request -- scoped
routing key, session lookup, cache_aware select with the exact view, remembering it -- p50 / p99.

Cached share with and without shared-L3 credit: sessions of conversation groups arrive over
time on workers whose caches fill up (LRU-capped); a page that some worker wrote to its L2
is in the shared L3 (Mooncake Store) for every worker. The share is the prompt tokens the
chosen worker serves without recomputing (its L1/L2, plus the shared L3), under routing that
ignores the shared L3 (``shared_l3_weight: 0``) and routing that credits it.
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any

import psutil

from common.tenants import parse_tenants
from hicache.keys import page_keys
from router.approx_tree import token_key
from router.cache_view import L1, L2, CacheView, WorkerCache
from router.config import RouterConfig
from router.policies import RouteRequest, make_policy
from router.tenancy import BoundedMap, salted_ids, scope_of, scope_prefix, session_key
from router.workers import Worker

VOCAB, PS, NS = 49152, 16, "bench|ns"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def _cfg(args: Any, l3: float) -> RouterConfig:
    return RouterConfig(max_tree_size=args.fleet_tree_tokens, cache_view="events", shared_l3_weight=l3,
                        max_worker_pages=args.fleet_page_cap, max_sessions=args.fleet_session_cap)


def fleet_bench(args: Any) -> dict[str, Any]:
    rng = random.Random(1)
    n = args.fleet_workers
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    cfg = _cfg(args, 0.0)
    policy = make_policy(cfg, CacheView(None, {}, 1.0, max_pages=cfg.max_worker_pages))  # type: ignore[arg-type]
    view = policy.view
    workers = [Worker(f"http://node{i // 8}:{30000 + i % 8}") for i in range(n)]
    tenants = parse_tenants({"keys": {f"sk-tenant-{t:04d}": f"t{t}" for t in range(args.fleet_tenants)}})
    scopes = [scope_of(t, {}) for t in tenants.tenants.values()]
    groups = [[rng.randrange(VOCAB) for _ in range(args.prefix_len)] for _ in range(4 * n)]
    for i, w in enumerate(workers):  # the events view: ~1M pages announced per worker, capped
        c = view.caches[w.url] = WorkerCache(epoch="e", namespace=NS, page_size=PS, max_pages=cfg.max_worker_pages)
        for lo in range(0, args.fleet_pages, 65536):
            c.apply("add", "L1", [f"{i:04x}{j:028x}" for j in range(lo, min(lo + 65536, args.fleet_pages))])
        for g in groups[4 * i: 4 * i + 4]:  # its real prefixes, announced last (most recent)
            c.apply("add", "L1", page_keys(salted_ids(g, scopes[i % len(scopes)]), PS, NS))
        while policy.tree.sizes.get(w.url, 0) < args.fleet_tree_tokens:
            ids = rng.choice(groups[4 * i: 4 * i + 4]) + [rng.randrange(VOCAB) for _ in range(args.suffix_len)]
            scope = scopes[i % len(scopes)]
            policy.on_sent(RouteRequest(scope_prefix(scope) + token_key(ids), salted_ids(ids, scope)), w)
        policy.maintain()
    sessions = BoundedMap(cfg.max_sessions)
    for s in range(args.fleet_sessions):
        sessions[session_key(scopes[s % len(scopes)], f"session-{s}")] = workers[s % n].url
    build_s, rss = time.perf_counter() - t0, _rss_mb()
    gc.freeze()  # as the router's upkeep does (router/app.py): long-lived structures leave the GC's scans
    by_url = {w.url: w for w in workers}
    times = []
    for q in range(args.queries):
        g = rng.randrange(len(groups))
        ids = groups[g] + [rng.randrange(VOCAB) for _ in range(args.suffix_len)]
        scope, sid = scopes[(g // 4) % len(scopes)], f"session-{rng.randrange(2 * args.fleet_sessions)}"
        for w in workers:
            w.polled_load = rng.randrange(4)
        t = time.perf_counter_ns()
        req = RouteRequest(scope_prefix(scope) + token_key(ids), salted_ids(ids, scope), session_key(scope, sid))
        owner = sessions.get(req.session_id)
        w = by_url[owner] if owner is not None else policy.select(req, workers)
        sessions[req.session_id] = w.url
        policy.on_sent(req, w)
        times.append((time.perf_counter_ns() - t) / 1e3)
        if q % 500 == 499:
            policy.maintain()  # the router's periodic upkeep (eviction_interval_s)
    policy.maintain()
    stats = view.stats()
    return {
        "workers": n, "pages_announced_per_worker": args.fleet_pages, "build_s": round(build_s, 1),
        "rss_mb": round(rss, 1), "rss_growth_mb": round(rss - rss0, 1),
        "view_pages": stats["pages"], "view_pages_dropped": stats["pages_dropped"],
        "page_cap_per_worker": cfg.max_worker_pages,
        "tree_tokens": sum(policy.tree.sizes.values()), "tree_cap_per_worker": cfg.max_tree_size,
        "sessions": len(sessions), "sessions_evicted": sessions.evicted, "session_cap": cfg.max_sessions,
        "decision_p50_us": round(pct(times, 0.5), 1), "decision_p99_us": round(pct(times, 0.99), 1),
        "decision_max_us": round(max(times), 1),
    }


def share_bench(args: Any) -> list[dict[str, Any]]:
    """Cached share (local tiers + shared L3) with and without shared-L3 credit in routing."""
    rows = []
    for l3 in (0.0, args.shared_l3_weight):
        rng = random.Random(2)
        cfg = RouterConfig(cache_view="events", shared_l3_weight=l3, max_worker_pages=args.share_page_cap)
        view = CacheView(None, {}, 1.0, shared_l3_weight=l3, max_pages=cfg.max_worker_pages)  # type: ignore[arg-type]
        policy = make_policy(cfg, view)
        workers = [Worker(f"http://w{i}") for i in range(args.share_workers)]
        for w in workers:
            view.caches[w.url] = WorkerCache(epoch="e", namespace=NS, page_size=PS, max_pages=cfg.max_worker_pages,
                                             l3=view.l3 if l3 else None)
        l3_store: set[str] = set()
        groups = [[rng.randrange(VOCAB) for _ in range(args.prefix_len)] for _ in range(args.share_groups)]
        local = shared = total = 0
        recent: list[Worker] = []  # the load: requests still running (the last few routed)
        placed = dict.fromkeys((w.url for w in workers), 0)
        for _ in range(args.share_requests):
            ids = rng.choice(groups) + [rng.randrange(VOCAB) for _ in range(args.suffix_len)]
            for w in workers:
                w.polled_load = 0
            for w in recent[-2 * len(workers):]:
                w.polled_load += 1
            w = policy.select(RouteRequest(token_key(ids), ids), workers)
            recent.append(w)
            placed[w.url] += 1
            keys = page_keys(ids, PS, NS)
            c = view.caches[w.url]
            held, _ = c.held(keys)
            in_l3 = 0
            while held + in_l3 < len(keys) and keys[held + in_l3] in l3_store:
                in_l3 += 1
            local, shared, total = local + held * PS, shared + in_l3 * PS, total + len(ids)
            c.apply("add", "L1", keys)
            c.apply("add", "L2", keys)  # write-through: on L2, so written to the shared L3
            l3_store.update(keys)
        rows.append({"routing": f"shared_l3_weight {l3:g}", "local_share": round(local / total, 3),
                     "l3_share": round(shared / total, 3), "cached_share": round((local + shared) / total, 3),
                     "busiest_worker_x_mean": round(max(placed.values()) * len(workers) / args.share_requests, 2),
                     "decisions": dict(policy.decisions)})
    return rows


def add_args(p: Any) -> None:
    p.add_argument("--fleet-workers", type=int, default=64)
    p.add_argument("--fleet-pages", type=int, default=1_000_000)
    p.add_argument("--fleet-page-cap", type=int, default=100_000)
    p.add_argument("--fleet-tree-tokens", type=int, default=100_000)
    p.add_argument("--fleet-sessions", type=int, default=10_000)
    p.add_argument("--fleet-session-cap", type=int, default=10_000)
    p.add_argument("--fleet-tenants", type=int, default=8)
    p.add_argument("--shared-l3-weight", type=float, default=0.5)
    p.add_argument("--share-workers", type=int, default=8)
    p.add_argument("--share-groups", type=int, default=64)
    p.add_argument("--share-requests", type=int, default=2000)
    p.add_argument("--share-page-cap", type=int, default=600)
    p.add_argument("--no-fleet", action="store_true")


__all__ = ["L1", "L2", "add_args", "fleet_bench", "share_bench"]
