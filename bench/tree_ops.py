"""Bookkeeping cost of the HiRadixTree on a multi-user multi-turn chat trace (no KV, no tensors).

Trace: ``users`` users x ``turns`` turns sharing a system prompt; each turn appends
``user_tokens`` user tokens to the user's history, the request's output adds
``output_tokens``. Per request: match, load-back of L2 hits, lock, allocate the new
pages (evicting L1 if needed), insert prompt+output, free duplicates, unlock, drain
transfers. Scenarios:

- ``unbounded``: the pool-less tree (nothing is ever evicted);
- ``l1_100k``: an L1 of ``--l1-tokens`` tokens (a PageAllocator, pure Python);
- ``l1_100k_l2_400k``: plus an L2 of ``--l2-ratio`` x L1 (hits on L2 are loaded back).

Prints µs per request and token hit rate (tokens served from L1, or loaded from L2,
over prompt tokens); ``--json PATH`` writes ``{scenario: {"us_per_request", "hit_rate"}}``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without installing the repo

from hicache.hiradix import HiRadixTree  # noqa: E402
from hicache.tiers.allocator import PageAllocator  # noqa: E402

Trace = list[tuple[list[int], list[int]]]


def make_trace(
    users: int, turns: int, system_tokens: int, user_tokens: int, output_tokens: int, seed: int
) -> Trace:
    rng = random.Random(seed)

    def rand(n: int) -> list[int]:
        return [rng.randrange(32000) for _ in range(n)]

    system = rand(system_tokens)
    history = [list(system) for _ in range(users)]
    trace: Trace = []
    for _ in range(turns):
        order = list(range(users))
        rng.shuffle(order)
        for u in order:
            prompt = history[u] + rand(user_tokens)
            output = rand(output_tokens)
            trace.append((prompt, output))
            history[u] = prompt + output
    return trace


def replay(trace: Trace, page_size: int, l1_tokens: int | None, l2_tokens: int | None) -> dict:
    device = PageAllocator(l1_tokens // page_size) if l1_tokens else None
    host = PageAllocator(l2_tokens // page_size) if l2_tokens else None
    tree = HiRadixTree(page_size, device, host)
    dev = tree.device
    hit = total = transfers = 0
    start = time.perf_counter()
    for prompt, output in trace:
        m = tree.match_prefix(prompt)
        total += len(prompt)
        loaded = False
        if m.host_hit_tokens:
            before = m
            m = tree.load_back(m)
            loaded = m is not before
        hit += m.device_hit_tokens
        tree.lock(m.last_device_node)
        full = prompt + output
        need = len(full) // page_size - len(m.device_pages)
        if dev.num_free < need:
            tree.evict_device(need - dev.num_free)
        if dev.num_free >= need:  # otherwise the request would not be admitted
            dup = tree.insert(full, m.device_pages + dev.alloc(need))
            if dup:
                dev.free(dup)
        tree.unlock(m.last_device_node)
        if loaded:
            tree.finish_load(m.last_device_node)
        transfers += len(tree.take_transfers())
    elapsed = time.perf_counter() - start
    tree.check_integrity()
    return {
        "us_per_request": elapsed / len(trace) * 1e6,
        "hit_rate": hit / total,
        "nodes": tree.num_nodes,
        "l1_pages": tree.cached_pages("device"),
        "l2_pages": tree.cached_pages("host") if host else 0,
        "transfers": transfers,
    }


def main(argv: list[str] | None = None) -> dict[str, dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--user-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--l1-tokens", type=int, default=100_000)
    ap.add_argument("--l2-ratio", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    args = ap.parse_args(argv)

    trace = make_trace(
        args.users, args.turns, args.system_tokens, args.user_tokens, args.output_tokens, args.seed
    )
    l2 = int(args.l1_tokens * args.l2_ratio)
    scenarios = {
        "unbounded": (None, None),
        "l1_100k": (args.l1_tokens, None),
        "l1_100k_l2_400k": (args.l1_tokens, l2),
    }
    results = {name: replay(trace, args.page_size, l1, l2_) for name, (l1, l2_) in scenarios.items()}

    print(f"{len(trace)} requests, page size {args.page_size}, L1 {args.l1_tokens} tokens, L2 {l2} tokens")
    print(f"{'scenario':<18} {'us/request':>10} {'hit rate':>9} {'nodes':>6} {'L1 pages':>9} {'L2 pages':>9}")
    for name, r in results.items():
        print(
            f"{name:<18} {r['us_per_request']:>10.1f} {r['hit_rate']:>9.3f} {r['nodes']:>6} "
            f"{r['l1_pages']:>9} {r['l2_pages']:>9}"
        )
    if args.json is not None:
        out = {
            k: {"us_per_request": v["us_per_request"], "hit_rate": v["hit_rate"]} for k, v in results.items()
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
