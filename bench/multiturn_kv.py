"""Compact L2/L3 encodings in the multi-turn bench: what the same L2/L3 bytes hold, and agreement.

Run through ``bench/multiturn.py --kv-encodings raw,fp8,int8 [--l2-mb 16 --l3-mb 48]``. For each
encoding (used for both L2 and L3) the multi-turn workload runs on L1 + L2 + L3 (LMDB) with the
same L2 bytes (``hicache_size``) and the same LMDB capacity, and reports:

- pages: L2 capacity and pages held at the end, L3 entries at the end;
- conversations held: users whose last prompt (its full pages) is still cached, in L1/L2 (tree
  lookup) or in L3 (its page keys present), and in either;
- hit rate and TTFT of returning turns, as ``bench/multiturn.py`` measures them;
- agreement with raw (teacher-forced, no cache involved): top-1 agreement of the next-token
  argmax over a fixed English text and over every user's first prompt (identical in every
  mode), and the perplexity of the fixed text; the same for L1 in bf16 and in fp8_e4m3
  (``--kv-cache-dtype``, lower tiers raw).

Each mode's conversations include its own greedy answers; answers have a fixed length
(``ignore_eos``), so every mode's KV working set has the same size.
"""

from __future__ import annotations

import math
from typing import Any

from bench.common import print_table, write_json

# Fixed text of the agreement and perplexity rows (public domain: Dickens, A Tale of Two Cities, ch. 1).
FIXED_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
    "was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything "
    "before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the "
    "other way -- in short, the period was so far like the present period, that some of its noisiest "
    "authorities insisted on its being received, for good or for evil, in the superlative degree of comparison "
    "only. There were a king with a large jaw and a queen with a plain face, on the throne of England; there "
    "were a king with a large jaw and a queen with a fair face, on the throne of France. In both countries it "
    "was clearer than crystal to the lords of the State preserves of loaves and fishes, that things in general "
    "were settled for ever."
)


def _held(core, prompts: list[list[int]]) -> dict[str, Any]:  # noqa: ANN001 - an EngineCore
    from hicache.keys import page_keys

    ps = core.config.cache.page_size
    storage = core.storage
    in_l12 = in_l3 = either = 0
    for ids in prompts:
        full = len(ids) - len(ids) % ps
        _, on_l12 = core.tree.lookup(ids[:full])
        on_l3 = 0
        if storage is not None:
            keys = page_keys(ids[:full], ps, storage.writeback.namespace)
            on_l3 = storage.tier.batch_exists(keys) * ps
        in_l12 += on_l12 >= full
        in_l3 += on_l3 >= full
        either += max(on_l12, on_l3) >= full
    backend = storage.tier.backend.stats() if storage is not None else {}
    return {
        "l2_capacity_pages": core.host_pool.num_pages if core.host_pool is not None else 0,
        "l2_pages_held": core.tree.cached_pages("host"),
        "l2_bytes": core.host_pool.nbytes() if core.host_pool is not None else 0,
        "l3_entries": int(backend.get("entries", 0)),
        "l3_capacity_bytes": int(backend.get("capacity_bytes", 0)),
        "l3_value_bytes": storage.tier.codec.value_nbytes if storage is not None else 0,
        "conversations": len(prompts),
        "conversations_held_l1_l2": int(in_l12), "conversations_held_l3": int(in_l3),
        "conversations_held": int(either),
    }


def _teacher_forced(args, mode: dict[str, Any], texts: list[list[int]]) -> list[dict[str, Any]]:  # noqa: ANN001
    """Per text: the top-1 token at every position and the mean log-likelihood (prompt logprobs)."""
    from serving.engine import Engine
    from serving.runner.logprobs import LogprobState

    # L1 only; a lossy encoding's round trip on every stored K/V, or L1 in another KV dtype
    eng = Engine(model_path=args.model_path, page_size=args.page_size, device=args.device, **mode)
    core, out = eng.core, []
    try:
        for ids in texts:
            r = core.make_request(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 1})
            r.logprob = LogprobState.from_request({"start_len": 0, "top": 1}, ids, core.runner.arch.vocab_size)
            core.add(r)
            while not r.finished:
                core.step()
            lps = [p[0] for p in r.logprob.input[1:]]
            top1 = [t[0][1] for t in r.logprob.input_top if t]
            out.append({"top1": top1, "mean_logprob": sum(lps) / len(lps)})
    finally:
        eng.shutdown()
    return out


def _agreement(mine: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, float]:
    """Top-1 agreement with ``base`` on the fixed text (first entry) and the prompts; perplexity."""
    same = [sum(a == b for a, b in zip(x["top1"], y["top1"], strict=True)) for x, y in zip(mine, base, strict=True)]
    n = [len(x["top1"]) for x in base]
    ppl = math.exp(-mine[0]["mean_logprob"])
    return {"top1_agreement_fixed_text": same[0] / n[0], "top1_agreement_first_prompts": sum(same[1:]) / sum(n[1:]),
            "ppl_fixed_text": ppl, "ppl_delta_fixed_text": ppl / math.exp(-base[0]["mean_logprob"]) - 1}


def compare_encodings(args, workload, run_setup) -> dict:  # noqa: ANN001
    """``run_setup``: bench/multiturn.py's (passed in: that module imports this one)."""
    system, turns = workload
    encodings = args.kv_encodings.split(",")
    l3_cfg = {"capacity_gb": args.l3_mb / 1024, "initial_map_mb": 4}
    results: dict[str, dict[str, Any]] = {}
    for enc in encodings:
        extra = {"hicache_size": args.l2_mb / 1024, "hicache_write_policy": "write_through",
                 "hicache_storage_backend": "lmdb", "hicache_storage_prefetch_policy": "wait_complete",
                 "hicache_storage_prefetch_threshold": 32, "hicache_storage_backend_extra_config": l3_cfg,
                 "hicache_l2_encoding": enc, "hicache_l3_encoding": enc}
        results[enc] = run_setup(enc, extra, args, system, turns, inspect=_held)
        print(f"{enc}: done in {results[enc]['elapsed_s']:.0f} s", flush=True)
    from serving.tokenizer import Tokenizer

    fixed = Tokenizer(args.model_path).encode(FIXED_TEXT)
    texts = [fixed] + [system + t[0] for t in turns]
    forced = {enc: _teacher_forced(args, {"hicache_l2_encoding": enc}, texts) for enc in encodings}
    base = forced.get("raw") or forced[encodings[0]]
    for enc in encodings:
        results[enc].update(_agreement(forced[enc], base))
    l1_modes = {f"L1 {d}": _agreement(_teacher_forced(args, {"kv_cache_dtype": d}, texts), base)
                for d in ("bf16", "fp8_e4m3")}
    raw = results.get("raw")
    for r in results.values():
        r["conversations_held_vs_raw"] = r["conversations_held"] / raw["conversations_held"] \
            if raw and raw["conversations_held"] else float("nan")
    print_table(["L2/L3", "L2 pages", "L2 held", "L3 entries", "convs held", "L1/L2", "L3", "x raw", "hit rate",
                 "TTFT p50", "TTFT p90", "top1 text", "top1 prompts", "ppl"],
                [[e, r["l2_capacity_pages"], r["l2_pages_held"], r["l3_entries"],
                  f"{r['conversations_held']}/{r['conversations']}", r["conversations_held_l1_l2"],
                  r["conversations_held_l3"], r["conversations_held_vs_raw"], r["hit_rate"], r["ttft_p50_s"],
                  r["ttft_p90_s"], r["top1_agreement_fixed_text"], r["top1_agreement_first_prompts"],
                  r["ppl_fixed_text"]] for e, r in results.items()])
    print_table(["L1 KV dtype (L2/L3 raw)", "top1 text", "top1 prompts", "ppl", "ppl delta"],
                [[m, r["top1_agreement_fixed_text"], r["top1_agreement_first_prompts"], r["ppl_fixed_text"],
                  r["ppl_delta_fixed_text"]] for m, r in l1_modes.items()])
    data = {"l1_kv_dtypes_vs_raw": l1_modes,
            "l2_mb": args.l2_mb, "l3_mb": args.l3_mb, "l1_tokens": args.l1_tokens, "users": args.users,
            "turns": args.turns, "model": args.model_path, "fixed_text_tokens": len(fixed), "encodings": results}
    write_json(args.json, data)
    return data
