"""L3 at the scale it exists for, in one run: ceilings, time to first token per tier, multi-turn.

    python3 bench/gpu_tiers.py [--json bench/results/gpu-tiers-DATE.json] [--shape 8b|small]

1. ceilings: pinned host -> GPU copy; a large file read from the page cache into pinned
   memory (1 and N threads) and from disk (the file dropped from the page cache); LMDB raw
   reads (py-lmdb views copied into pinned memory, 1 and N threads) and one LMDB write
   transaction of page-sized values;
2. TTFT of a 4,096-token prompt (median of several prompts) through the offline ``Engine``:
   recompute (cold), L1 hit (the suffix prefill), L2 hit (L1 evicted to L2), L3 hit warm (a
   restarted engine; the store in the page cache), L3 cold (restarted, the data file dropped
   from the page cache with ``posix_fadvise(DONTNEED)``) under the cost model, which first
   measures the store (one load) and then decides; L3 read / write GB/s from the tier's own
   counters (bytes over time inside its reads / writes);
3. multi-turn: 16 conversations with a 4,096-token context, 4 turns (+32 answer, +256 user
   tokens each); L1 only / L1+L2 / L1+L2+L3 with a small L1 (16k tokens) and an L2 that
   holds part of the working set. Two modes: serial (one request at a time; returning-turn
   TTFT, throughput = prompt tokens over the sum of TTFTs) and concurrent (each turn's 16
   requests at once; throughput = prompt tokens over the turn's wall time, the
   ``multiturn_tput_*`` keys and the goal). Between turns the users "think" until
   write-backs have drained (not timed).

Greedy outputs of every cache hit are compared with the recompute of the same prompt
(``*_same_tokens``; bf16, so equality is reported, not required). ``--shape small`` runs
the same code with a 2-layer model (a smoke run; CPU works too).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402
from bench.gpu_model import LLAMA_8B, rand_prompts  # noqa: E402
from bench.gpu_tiers_sections import ceilings, drop_page_cache, sync  # noqa: E402

SMALL = {**LLAMA_8B, "num_hidden_layers": 2, "hidden_size": 512, "intermediate_size": 1024,
         "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000}
ONE = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 1}


def make_engine(args, model_dir, l3_dir: str | None, **kw):
    from serving.engine import Engine

    base = dict(model_path=model_dir, load_format="dummy", dtype=args.dtype, device=args.device, page_size=16,
                hicache_mem_layout="page_first", disable_cuda_graph=True, disable_overlap_schedule=True,
                chunked_prefill_size=8192, max_running_requests=16)
    if l3_dir is not None:
        base.update(hicache_storage_backend="lmdb", hicache_storage_prefetch_policy="wait_complete",
                    hicache_storage_prefetch_timeout_base=60.0, hicache_storage_prefetch_threshold=256,
                    hicache_storage_read_threads=args.read_threads,
                    hicache_storage_backend_extra_config={"path": l3_dir, "capacity_gb": args.l3_gb, "sync": False})
    base.update(kw)
    return Engine(**base)


def timed(eng, ids) -> tuple[float, dict]:
    sync()
    t0 = time.perf_counter()
    out = eng.generate(input_ids=ids, sampling_params=ONE)
    sync()
    return time.perf_counter() - t0, out


def tier_gbps(eng, before: dict, kind: str) -> float:
    """GB/s inside the tier's reads (``kind="read"``) or writes (``"write"``) since ``before``."""
    st = eng.core.storage.tier.stats()
    nbytes_key = "bytes_read" if kind == "read" else "bytes_written"
    nbytes = st[nbytes_key] - before.get(nbytes_key, 0)
    secs = st[f"{kind}_s"] - before.get(f"{kind}_s", 0)
    return nbytes / secs / 1e9 if secs > 0 else 0.0


def ttft_section(res: dict, args, model_dir: str, work: str) -> None:
    vocab, n = args.vocab, args.prompts
    prompts = rand_prompts(n, args.context, vocab, seed=21)
    warm = rand_prompts(4, args.context, vocab, seed=22)
    l3 = os.path.join(work, "l3")
    # -- recompute, L1, L2 ---------------------------------------------------------------
    eng = make_engine(args, model_dir, l3, max_total_tokens=(n + 2) * (args.context + 64),
                      hicache_size=args.l2_gb, hicache_storage_load_policy="always_load")
    for p in warm[:2]:
        eng.generate(input_ids=p, sampling_params=ONE)
    rec, ref = [], []
    for p in prompts:
        dt, out = timed(eng, p)
        rec.append(dt)
        ref.append(out["output_ids"])
    for p in prompts:  # the first hit backs the prompt up to L2 (write_through); time the second
        timed(eng, p)
    l1 = [timed(eng, p)[0] for p in prompts]
    steps, dec = 32, []  # a batch-1 decode step: 1 + 32 new tokens minus 1 new token, both L1 hits
    for p, t1 in zip(prompts, l1, strict=True):
        sync()
        t0 = time.perf_counter()
        eng.generate(input_ids=p, sampling_params={**ONE, "max_new_tokens": 1 + steps})
        sync()
        dec.append((time.perf_counter() - t0 - t1) / steps)
    l2, l2_same = [], True
    for i, p in enumerate(prompts):
        tree = eng.core.tree
        tree.evict_device(tree.cached_pages("device"))  # demote everything to L2
        eng.core.req_cache.flush_transfers()
        sync()
        dt, out = timed(eng, p)
        l2.append(dt)
        l2_same &= out["output_ids"] == ref[i]
        assert out["meta_info"]["cached_tokens_details"]["host"] > 0, out["meta_info"]
    res["ttft_recompute_s"] = statistics.median(rec)
    res["ttft_l1_s"] = statistics.median(l1)
    res["decode_step_s"] = statistics.median(dec)
    res["ttft_l2_s"] = statistics.median(l2)
    res["l2_same_tokens"] = l2_same
    page_bytes = eng.core.storage.tier.codec.page_nbytes
    pages = args.context // 16 - 1
    res["kv_bytes_per_prompt"] = pages * page_bytes
    res["suffix_prefill_plus_copy_s"] = res["ttft_l1_s"] + pages * page_bytes / (res.get("pinned_h2d_gbps", 55) * 1e9)
    t0 = time.perf_counter()
    eng.shutdown()  # persists every page (L1 -> L2 -> L3)
    persist_s = time.perf_counter() - t0
    # -- L3 warm (restart) -----------------------------------------------------------------
    eng = make_engine(args, model_dir, l3, max_total_tokens=(n + 2) * (args.context + 64),
                      hicache_size=args.l2_gb, hicache_storage_load_policy="always_load")
    for p in warm[:2]:
        eng.generate(input_ids=p, sampling_params=ONE)
    before = eng.core.storage.tier.stats()
    l3w, l3w_same = [], True
    for i, p in enumerate(prompts):
        dt, out = timed(eng, p)
        l3w.append(dt)
        l3w_same &= out["output_ids"] == ref[i]
        assert out["meta_info"]["cached_tokens_details"]["storage"] > 0, out["meta_info"]
    res["ttft_l3_warm_s"] = statistics.median(l3w)
    res["l3_warm_same_tokens"] = l3w_same
    res["l3_warm_read_gbps"] = tier_gbps(eng, before, "read")
    extra = res["ttft_l3_warm_s"] - res["ttft_l1_s"]  # what the load added to the suffix prefill
    if extra > 1e-3:
        res["l3_warm_effective_gbps"] = res["kv_bytes_per_prompt"] / extra / 1e9
    eng.shutdown()
    # -- write rate: a fresh store written by a shutdown -------------------------------------
    l3b = os.path.join(work, "l3-write")
    eng = make_engine(args, model_dir, l3b, max_total_tokens=(n + 2) * (args.context + 64),
                      hicache_size=args.l2_gb)
    for p in prompts:
        eng.generate(input_ids=p, sampling_params=ONE)
    eng.core.tree.backup_all()
    eng.core.req_cache.flush_transfers()
    eng.core.storage.persist_all()
    res["l3_write_gbps"] = tier_gbps(eng, {}, "write")
    res["persist_wall_s"] = persist_s
    eng.shutdown()
    shutil.rmtree(l3b, ignore_errors=True)
    # -- L3 cold, cost model -----------------------------------------------------------------
    drop_page_cache(os.path.join(l3, "data.mdb"))
    eng = make_engine(args, model_dir, l3, max_total_tokens=(n + 2) * (args.context + 64),
                      hicache_size=args.l2_gb)  # cost_model (the default)
    for p in rand_prompts(4, args.context, vocab, seed=23):  # never stored: the prefill rate
        eng.generate(input_ids=p, sampling_params=ONE)
    before = eng.core.storage.tier.stats()
    first_dt, first = timed(eng, prompts[0])  # nothing known about the store yet: it loads
    res["ttft_l3_cold_first_s"] = first_dt
    res["l3_cold_read_gbps"] = tier_gbps(eng, before, "read")
    cold, decisions, cold_same = [], [], True
    for i, p in enumerate(prompts[1:], start=1):
        dt, out = timed(eng, p)
        cold.append(dt)
        decisions.append(out["meta_info"].get("l3_decision"))
        cold_same &= out["output_ids"] == ref[i]
    res["ttft_l3_cold_s"] = statistics.median(cold)
    fresh = rand_prompts(3, args.context, vocab, 24)  # recompute in this engine, for comparison
    res["ttft_recompute_again_s"] = statistics.median(timed(eng, q)[0] for q in fresh)
    res["l3_cold_decisions"] = decisions
    res["l3_cold_same_tokens"] = cold_same
    res["cost_model_stats"] = {k: v for k, v in eng.core.storage_stats().items() if k.startswith("cost_")}
    eng.shutdown()


def _multiturn_run(args, model_dir: str, l3: str | None, extra: dict, concurrent: bool) -> dict:
    """One setup, one mode. Serial: conversations take turns one request at a time (a user
    waits for the answer) and every returning request's TTFT is timed. Concurrent: each turn
    sends all conversations at once (one batch) and its wall time is timed. Throughput =
    prompt tokens of returning turns over the time they took (sum of TTFTs / of turn walls)."""
    vocab, convs, turns = args.vocab, args.conversations, args.turns
    eng = make_engine(args, model_dir, l3, max_total_tokens=args.mt_l1_tokens, **extra)
    hist = rand_prompts(convs, args.context, vocab, seed=31)
    more = rand_prompts(convs * turns, args.mt_user + args.mt_answer, vocab, seed=32)
    for p in rand_prompts(4, 1024, vocab, 33):
        eng.generate(input_ids=p, sampling_params=ONE)
    times, tokens, hits = [], 0, {"device": 0, "host": 0, "storage": 0}
    for t in range(turns):
        if concurrent:
            dt, outs = timed(eng, hist)
            per = [(dt, o) for o in outs]
            if t > 0:
                times.append(dt)
        else:
            per = [timed(eng, hist[c]) for c in range(convs)]
            if t > 0:
                times.extend(dt for dt, _ in per)
        for c, (_, o) in enumerate(per):
            if t > 0:
                tokens += len(hist[c])
                for k, v in o["meta_info"]["cached_tokens_details"].items():
                    hits[k] += v
            hist[c] = hist[c] + o["output_ids"] + more[c * turns + t]
        if eng.core.storage is not None:  # the users think; write-backs drain (not timed)
            eng.core.storage.poll(wait=True)
    out = {"prompt_tok_s": tokens / sum(times), "hit_tokens": hits}
    if not concurrent:
        out.update(ttft_p50_s=statistics.median(times), ttft_mean_s=statistics.mean(times))
    else:
        out["turn_wall_p50_s"] = statistics.median(times)
    if eng.core.storage is not None:
        st = eng.core.storage_stats()
        out["storage"] = {k: st[k] for k in ("pages_written", "hits", "pages_prefetched", "read_s",
                                             "write_pages_dropped", "cost_l3_refusals",
                                             "cost_l3_read_gbps", "cost_prefill_tok_s")}
    eng.check_integrity()
    eng.shutdown()
    return out


def multiturn_section(res: dict, args, model_dir: str, work: str) -> None:
    """Both modes of :func:`_multiturn_run` for L1 only / L1+L2 / L1+L2+L3. The goal's
    throughput is the concurrent one (prompt throughput of a whole turn); the serial run
    gives the returning-turn TTFT."""
    out: dict = {"serial": {}, "concurrent": {}}
    setups = {"l1_only": ({}, False), "l1_l2": ({"hicache_size": args.mt_l2_gb}, False),
              "l1_l2_l3": ({"hicache_size": args.mt_l2_gb}, True)}
    for mode in out:
        for name, (extra, with_l3) in setups.items():
            l3 = os.path.join(work, f"mt-{mode}-{name}") if with_l3 else None
            out[mode][name] = _multiturn_run(args, model_dir, l3, dict(extra), mode == "concurrent")
            print(f"multi-turn {mode} {name}: {out[mode][name]}", flush=True)
            if l3:
                shutil.rmtree(l3, ignore_errors=True)
    res["multiturn"] = {"conversations": args.conversations, "turns": args.turns, "context": args.context,
                        "l1_tokens": args.mt_l1_tokens, "l2_gb": args.mt_l2_gb, **out}
    for name, key in (("l1_only", "l1"), ("l1_l2", "l2"), ("l1_l2_l3", "l3")):
        res[f"multiturn_tput_{key}_tok_s"] = out["concurrent"][name]["prompt_tok_s"]
        res[f"multiturn_serial_tput_{key}_tok_s"] = out["serial"][name]["prompt_tok_s"]
        res[f"multiturn_serial_ttft_p50_{key}_s"] = out["serial"][name]["ttft_p50_s"]


def goals(res: dict) -> dict:
    g = {}
    if "l3_warm_read_gbps" in res:
        g["l3_warm_read >= 10 GB/s"] = res["l3_warm_read_gbps"] >= 10
        g["ttft_l3_warm <= 2x ttft_l2"] = res["ttft_l3_warm_s"] <= 2 * res["ttft_l2_s"]
        g["ttft_l3_warm <= 0.3x recompute"] = res["ttft_l3_warm_s"] <= 0.3 * res["ttft_recompute_s"]
        # the cost model's job: against recompute in the same engine, measured right after (engine-to-engine
        # drift of a few % would otherwise decide it); ttft_recompute_s stays in the table
        g["ttft_l3_cold <= 1.05x recompute"] = res["ttft_l3_cold_s"] <= 1.05 * res.get(
            "ttft_recompute_again_s", res["ttft_recompute_s"])
        g["ttft_l2 <= 1.3x (suffix + copy)"] = res["ttft_l2_s"] <= 1.3 * res["suffix_prefill_plus_copy_s"]
        if "lmdb_put_gbps" in res:
            g["l3_write >= 0.8x lmdb put"] = res["l3_write_gbps"] >= 0.8 * res["lmdb_put_gbps"]
    if "decode_step_s" in res:
        g["ttft_l1 <= 1.6x decode step"] = res["ttft_l1_s"] <= 1.6 * res["decode_step_s"]
    if "multiturn_tput_l3_tok_s" in res:
        g["multiturn l3 >= 4x l1"] = res["multiturn_tput_l3_tok_s"] >= 4 * res["multiturn_tput_l1_tok_s"]
    return g


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["8b", "small"], default="8b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--l2-gb", type=float, default=16.0)
    p.add_argument("--l3-gb", type=float, default=48.0)
    p.add_argument("--read-threads", type=int, default=8)  # 16 measured slower (15.5 vs 20 GB/s, run7)
    p.add_argument("--ceiling-gb", type=float, default=2.0)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--mt-l1-tokens", type=int, default=16384)
    p.add_argument("--mt-l2-gb", type=float, default=4.0)
    p.add_argument("--mt-user", type=int, default=256)
    p.add_argument("--mt-answer", type=int, default=32)
    p.add_argument("--workdir", default=None, help="where the stores and the ceiling file go (local disk)")
    p.add_argument("--skip", default="", help="comma list: ceilings,ttft,multiturn")
    args = p.parse_args(argv)
    shape = LLAMA_8B if args.shape == "8b" else SMALL
    args.vocab = shape["vocab_size"]
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    skip = set(filter(None, args.skip.split(",")))
    res: dict = {"shape": args.shape, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "context_tokens": args.context}
    work = tempfile.mkdtemp(prefix="hicache-tiers-", dir=args.workdir)
    model_dir = os.path.join(work, "model")
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(shape, f)
    errors = []
    try:
        for name, fn in (("ceilings", lambda: ceilings(res, args, work)),
                         ("ttft", lambda: ttft_section(res, args, model_dir, work)),
                         ("multiturn", lambda: multiturn_section(res, args, model_dir, work))):
            if name in skip:
                continue
            try:
                fn()
            except Exception:  # noqa: BLE001 - a failing section is reported; the others still run
                import traceback

                errors.append(traceback.format_exc())
                print(f"{name} FAILED:\n{errors[-1]}", flush=True)
            write_json(args.json, {**res, "partial": True})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["goals"] = goals(res)
    if errors:
        res["errors"] = [e.splitlines()[-1] for e in errors]
    rows = [[k, v] for k, v in res.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    print_table(["what", "value"], rows)
    print("goals:", json.dumps(res["goals"], indent=1))
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
