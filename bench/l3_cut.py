"""An L3 load that falls behind recompute, cut (serving/cache/prefetch_policy.py's LoadBudget), on CPU.

    python3 bench/l3_cut.py [--tokens 2048] [--slow-mb-s 20] [--layout page_first|layer_first] [--json PATH]

SmolLM2-135M (real weights, fp32) with an LMDB L3 whose reads can be throttled (harness/slow_storage.py:
the real store, each read made to last as long as its bytes take at ``--slow-mb-s``: a slow or busy
disk). Three prompts of ``--tokens`` tokens are written to L3 by a first engine. A second engine learns
the prefill rate (three uncached prompts) and, from two full-speed L3 hits, that the store is fast; then
the store slows down and the third prompt comes back. Time to first token (one new token) of:

- **recompute**: an uncached prompt of the same length;
- **L3 hit, full speed**: the second stored prompt;
- **L3 hit, slow store, cut**: the third, with the cost model (the default): its fetch is cut once it is
  behind recompute, the rest recomputed;
- **L3 hit, slow store, no cut**: the same store and prompt with ``always_load`` (no estimate: it waits
  for the whole load, as before the cut existed).

Each answer is checked against the cold one. The goal the cut serves: an L3 hit never costs much more
than recompute (``x recompute`` <= 1.1 within this machine's noise).
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, print_table, write_json  # noqa: E402
from bench.cpu_decode import cpu_info  # noqa: E402
from harness.model_utils import smollm2_path  # noqa: E402
from harness.slow_storage import slow_lmdb_backend  # noqa: E402
from serving.engine import Engine  # noqa: E402

ONE = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}


def prompts(n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(tokens)] for _ in range(n)]


def ttft(eng: Engine, ids: list[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    out = eng.generate(input_ids=ids, sampling_params=ONE)
    return time.perf_counter() - t0, out


def run(tokens: int, slow_mb_s: float, layout: str) -> dict:
    warmup, stored, fresh = prompts(3, tokens, 1), prompts(3, tokens, 2), prompts(1, tokens, 3)
    cfg = dict(model_path=str(smollm2_path()), page_size=16, max_total_tokens=tokens * 2 + 256, hicache_ratio=2.0,
               hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=64,
               hicache_storage_prefetch_timeout_base=120.0, hicache_mem_layout=layout)
    with tempfile.TemporaryDirectory() as tmp, slow_lmdb_backend() as (backend, _):
        extra = {"path": os.path.join(tmp, "l3"), "capacity_gb": 2.0}
        warm = Engine(**cfg, hicache_storage_backend="lmdb", hicache_storage_backend_extra_config=extra)
        cold = [o["output_ids"] for o in warm.generate(input_ids=stored, sampling_params=ONE)]
        warm.shutdown()  # persists them to L3
        rows: dict[str, dict] = {}
        for policy in ("cost_model", "always_load"):
            eng = Engine(**cfg, hicache_storage_backend=backend, hicache_storage_backend_extra_config=extra,
                         hicache_storage_load_policy=policy)
            store = eng.core.storage.tier.backend
            for p in warmup:
                eng.generate(input_ids=p, sampling_params=ONE)
            if policy == "cost_model":
                rows["recompute"] = {"ttft_s": ttft(eng, fresh[0])[0], "storage_tokens": 0}
            for i, name in ((0, None), (1, "L3 hit, full speed")):
                s, out = ttft(eng, stored[i])
                assert out["output_ids"] == cold[i]
                eng.core.storage.poll(wait=True)
                if name and policy == "cost_model":
                    rows[name] = {"ttft_s": s, "storage_tokens": out["meta_info"]["cached_tokens_details"]["storage"]}
            store.read_mb_s = slow_mb_s
            s, out = ttft(eng, stored[2])
            assert out["output_ids"] == cold[2]
            name = "L3 hit, slow store, cut" if policy == "cost_model" else "L3 hit, slow store, no cut"
            rows[name] = {"ttft_s": s, "storage_tokens": out["meta_info"]["cached_tokens_details"]["storage"],
                          "l3_decision": out["meta_info"].get("l3_decision")}
            store.read_mb_s = 0.0
            eng.core.storage.poll(wait=True)
            eng.check_integrity()
            eng.shutdown()
        rec = rows["recompute"]["ttft_s"]
        for r in rows.values():
            r["x_recompute"] = r["ttft_s"] / rec
        return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--slow-mb-s", type=float, default=20.0)
    ap.add_argument("--layout", default="page_first", choices=["page_first", "layer_first"],
                    help="L2's layout: page_first reads LMDB directly in groups of <= 8 pages (the cut sees "
                         "progress at that grain); layer_first reads through staging buffers, one group each")
    args = ap.parse_args()
    rows = run(args.tokens, args.slow_mb_s, args.layout)
    print(f"SmolLM2-135M fp32, CPU, {args.tokens}-token prompts, slow store {args.slow_mb_s} MB/s, L2 {args.layout}")
    print_table(["case", "TTFT s", "x recompute", "tokens from L3", "cut"],
                [[k, v["ttft_s"], v["x_recompute"], v["storage_tokens"], bool((v.get("l3_decision") or {}).get("cut"))]
                 for k, v in rows.items()])
    write_json(args.json, {"tokens": args.tokens, "slow_mb_s": args.slow_mb_s, "layout": args.layout, "rows": rows,
                           "cpu": cpu_info()})


if __name__ == "__main__":
    main()
