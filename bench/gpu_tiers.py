"""L3 at the scale it exists for, in one run: ceilings, TTFT per tier, long contexts, multi-turn.

    python3 bench/gpu_tiers.py [--json bench/results/gpu-tiers-DATE.json] [--shape 8b|small]
        [--sections ceilings,ttft,longctx,multiturn] [--l3-backends lmdb|lmdb,mooncake]
        [--long-contexts 32768,102400] [--mt-modes serial,concurrent] [--eager]

The H200 run (issue 44): ``python3 bench/gpu_tiers.py --l3-backends lmdb,mooncake --json PATH``.
Every engine runs with the engine's default settings (CUDA graphs and overlap scheduling on:
what a user serves with); ``--eager`` turns both off, for a comparison. Section and engine
start-up times are in ``section_s`` / ``engine_init_s``. Engines are timed once their L2 is fully
pinned (L2 pins in the background while an engine serves; ``l2_pin_wait_s``), except those that
measure the first requests after a start, which serve at once as a server does.

1. ceilings: pinned host -> GPU copy; a large file read from the page cache into pinned
   memory (1 and N threads) and from disk (the file dropped from the page cache); LMDB raw
   reads (py-lmdb views copied into pinned memory, 1 and N threads) and one LMDB write
   transaction of page-sized values; the disk's raw write (``bench.common.raw_write``: the same
   bytes written sequentially to 1 file and to one file per LMDB shard, then fdatasync, best of 2;
   the faster is ``disk_write_gbps``) and the same without fdatasync (``page_cache_write_gbps``);
2. TTFT of a 4,096-token prompt (median of several prompts) through the offline ``Engine``:
   recompute (cold), L1 hit (the suffix prefill), a batch-1 decode step, L2 hit (L1 evicted
   to L2), L3 hit warm (a restarted engine; the store in the page cache), the first 8 returning
   requests of an engine restarted without waiting for its pinning (default load policy, a
   server's one-token warm-up; 8 prompts are stored: ``--prompts`` and more;
   ``ttft_l3_after_restart_s``), L3 cold (restarted, the store's files dropped from the page
   cache with ``posix_fadvise(DONTNEED)``) under the cost model, which first measures the store
   (one load) and then decides; L3 read / write GB/s from the tier's own counters (bytes over
   time inside its reads / writes; the write rate over the first engine's writes, its shutdown
   persist included; the bench's LMDB runs with ``sync`` off). With ``--l3-backends
   lmdb,mooncake`` the warm hit and the first 8 after a restart again on Mooncake Store (a real
   ``mooncake_master`` on 127.0.0.1: bench/gpu_tiers_l3.py); ``mooncake`` in the JSON, or
   ``"n/a: <reason>"`` where it cannot run (the run goes on);
3. longctx (bench/gpu_tiers_long.py): a 32k and a 100k-token context (``--long-contexts``), L1 =
   the context + 8k tokens, L2 = 3x L1, LMDB L3: recompute, L1, L2, L3 warm and, in an engine
   started on the store that serves at once, L3 / L1 / L2 / recompute right after start;
4. multi-turn: 16 conversations with a 4,096-token context, 4 turns (+32 answer, +256 user
   tokens each); L1 only / L1+L2 / L1+L2+L3 with a small L1 (16k tokens) and an L2 that
   holds part of the working set. Two modes: serial (one request at a time; returning-turn
   TTFT, throughput = prompt tokens over the sum of TTFTs) and concurrent (each turn's 16
   requests at once; throughput = prompt tokens over the turn's wall time, the
   ``multiturn_tput_*`` keys and the goal). Between turns the users "think" until
   write-backs have drained (not timed).

Goals (``goals``, printed as a table): issue 26's L1-hit TTFT <= 1.6x a batch-1 decode step;
L2-hit TTFT <= 1.3x max(L1-hit TTFT, KV bytes / pinned H2D GB/s); L3 warm read >= 0.8x LMDB's
raw N-thread read in the same run (N = the tier's reader threads); cold L3 <= 1.05x recompute (in
the same engine). Issue 44's: L3 warm hit <= 0.2x recompute, and so each of the first 8 after a
restart (on LMDB, and on Mooncake when measured); L3 write >= 0.8x the disk's raw write
(issue 26's reference, one LMDB put transaction, stays in the JSON: ``l3_write_over_lmdb_put``);
at each long context L2 <= 0.1x and L3 warm <= 0.2x recompute and no hit above 1.0x;
multi-turn concurrent L1+L2+L3 >= 4x L1 only.

Cost on one H200 at the 8B shape, meant to fit one device call (~10 minutes with start-ups): the
2026-12-02 run took ceilings 8.5 s, ttft 21 s, multi-turn 60 s, engine starts ~1 s each. Not yet
measured there, estimated: the raw writes add 5 x 2 GiB to the ceilings (~5-10 s); the first-8
engine a few s; Mooncake a child process with its master and 3 engines that store 8 x 4k prompts
(~4.4 GB) over TCP (~0.5-1 min); longctx ~15-20 s at 32k and ~1-1.5 min at 100k (two 100k
prefills of ~14 s, 13 GB written to and read from L3, 40 GiB of L2 per engine).

Greedy outputs of every cache hit are compared with the recompute of the same prompt
(``*_same_tokens``; bf16, so equality is reported, not required). ``--shape small`` runs
the same code with a 2-layer model (a smoke run; CPU works too; long contexts 2k and 4k).
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
from bench.gpu_tiers_l3 import (  # noqa: E402
    first_after_restart,
    fractions,
    l1_tokens,
    l3_warm,
    mooncake_l3,
    persist,
    stored_prompts,
)
from bench.gpu_tiers_long import long_goals, long_section  # noqa: E402
from bench.gpu_tiers_sections import (  # noqa: E402
    ONE,
    bytes_per_token,
    ceilings,
    close,
    drop_page_cache,
    make_engine,
    multiturn_section,
    sync,
    tier_gbps,
    timed,
)
from hicache.tiers.storage import default_read_threads  # noqa: E402

SMALL = {**LLAMA_8B, "num_hidden_layers": 2, "hidden_size": 512, "intermediate_size": 1024,
         "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000}
SECTIONS = ("ceilings", "ttft", "longctx", "multiturn")


def ttft_section(res: dict, args, model_dir: str, work: str) -> None:
    vocab = args.vocab
    prompts, stored, warm = stored_prompts(args)  # stored: the timed prompts, then more for the restart's first 8
    l3 = os.path.join(work, "l3")
    tokens = l1_tokens(args)
    # -- recompute, L1, decode step, L2 ----------------------------------------------------------
    eng = make_engine(args, model_dir, l3, max_total_tokens=tokens, hicache_size=args.l2_gb,
                      hicache_storage_load_policy="always_load")
    for p in warm[:2]:
        eng.generate(input_ids=p, sampling_params=ONE)
    rec, ref = [], []
    for p in prompts:
        dt, out = timed(eng, p)
        rec.append(dt)
        ref.append(out["output_ids"])
    for p in prompts:  # the first hit backs the prompt up to L2 (write_through); time the second
        timed(eng, p)
    l1_busy = [timed(eng, p)[0] for p in prompts]  # while those backups' L3 writes run on their threads
    l1 = []
    for p in prompts:  # as a user who comes back after the writes (bench/hybrid.py times its hits so)
        eng.core.storage.poll(wait=True)
        l1.append(timed(eng, p)[0])
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
    for p in stored[len(prompts):]:  # stored for the first requests after a restart (not timed)
        eng.generate(input_ids=p, sampling_params=ONE)
    res["ttft_recompute_s"] = statistics.median(rec)
    res["ttft_l1_s"] = statistics.median(l1)
    res["ttft_l1_writes_running_s"] = statistics.median(l1_busy)
    res["decode_step_s"] = statistics.median(dec)
    res["ttft_l2_s"] = statistics.median(l2)
    res["l2_same_tokens"] = l2_same
    page_bytes = eng.core.storage.tier.codec.page_nbytes
    pages = args.context // 16 - 1
    res["kv_bytes_per_prompt"] = pages * page_bytes
    copy_s = pages * page_bytes / (res.get("pinned_h2d_gbps", 55) * 1e9)
    res["suffix_prefill_plus_copy_s"] = res["ttft_l1_s"] + copy_s
    res["l2_floor_s"] = max(res["ttft_l1_s"], copy_s)  # the copy hidden under the layers
    # -- L3 write rate: every cached page written on to L3 (as a server's shutdown does) ---------
    persist(eng, res)
    close(eng, persist=True)
    # -- L3 warm (restart, L2 pinned); then the first requests of a restart that serves at once --
    l3_warm(res, args, model_dir, l3, prompts, warm, ref)
    extra = res["ttft_l3_warm_s"] - res["ttft_l1_s"]  # what the load added to the suffix prefill
    if extra > 1e-3:
        res["l3_warm_effective_gbps"] = res["kv_bytes_per_prompt"] / extra / 1e9
    first_after_restart(res, args, model_dir, l3, stored)
    fractions(res, res["ttft_recompute_s"])
    # -- L3 cold, cost model ---------------------------------------------------------------------
    drop_page_cache(l3)  # every shard's map and value files
    eng = make_engine(args, model_dir, l3, max_total_tokens=tokens, hicache_size=args.l2_gb)  # cost_model
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
    close(eng)
    # -- Mooncake Store as L3: the warm hit and the first requests after a restart again ---------
    if "mooncake" in args.l3_backends:
        mc = res["mooncake"] = mooncake_l3(args, model_dir, work, bytes_per_token(args.shape_cfg, args.dtype))
        print(f"mooncake: {mc}", flush=True)
        if isinstance(mc, dict):
            for k in ("ttft_recompute_s", "ttft_l3_warm_s", "l3_warm_x_recompute",
                      "ttft_l3_after_restart_max_x_recompute", "l3_write_gbps", "l3_warm_read_gbps"):
                res[f"mooncake_{k}"] = mc[k]


def goals(res: dict) -> dict:
    """Issue 26's goals, as it states them (see the module docstring)."""
    g = {}
    if "decode_step_s" in res:
        g["ttft_l1 <= 1.6x decode step"] = res["ttft_l1_s"] <= 1.6 * res["decode_step_s"]
    if "l2_floor_s" in res:
        g["ttft_l2 <= 1.3x max(ttft_l1, kv bytes / pinned h2d)"] = res["ttft_l2_s"] <= 1.3 * res["l2_floor_s"]
    if "ttft_l3_warm_s" in res:
        g["ttft_l3_warm <= 0.2x recompute"] = res["ttft_l3_warm_s"] <= 0.2 * res["ttft_recompute_s"]
        if "lmdb_raw_read_gbps" in res:
            g["l3_warm_read >= 0.8x lmdb raw N-thread read"] = \
                res["l3_warm_read_gbps"] >= 0.8 * res["lmdb_raw_read_gbps"]
    if "ttft_l3_cold_s" in res:
        # the cost model's job: against recompute in the same engine, measured right after (engine-to-engine
        # drift of a few % would otherwise decide it); ttft_recompute_s stays in the table
        g["ttft_l3_cold <= 1.05x recompute"] = res["ttft_l3_cold_s"] <= 1.05 * res.get(
            "ttft_recompute_again_s", res["ttft_recompute_s"])
    if "multiturn_tput_l3_tok_s" in res:
        g["multiturn concurrent l3 >= 4x l1"] = res["multiturn_tput_l3_tok_s"] >= 4 * res["multiturn_tput_l1_tok_s"]
    if "ttft_l3_after_restart_x_recompute" in res:
        g["ttft_l3 of each of the first 8 after a restart <= 0.2x recompute"] = \
            max(res["ttft_l3_after_restart_x_recompute"]) <= 0.2
    if "l3_write_gbps" in res and "disk_write_gbps" in res:  # issue 44 (issue 26's was >= 0.8x one LMDB put)
        g["l3_write >= 0.8x disk raw write"] = res["l3_write_gbps"] >= 0.8 * res["disk_write_gbps"]
    mc = res.get("mooncake")
    if mc is not None:
        g["mooncake store measured as L3"] = isinstance(mc, dict)
    if isinstance(mc, dict):
        g["mooncake: ttft_l3_warm <= 0.2x recompute"] = mc["l3_warm_x_recompute"] <= 0.2
        g["mooncake: ttft_l3 of each of the first 8 after a restart <= 0.2x recompute"] = \
            mc["ttft_l3_after_restart_max_x_recompute"] <= 0.2
    g.update(long_goals(res))
    return g


def ratios(res: dict) -> None:
    """Derived numbers of the table: the goals' ratios."""
    if "ttft_l3_warm_s" in res:
        res["ttft_l3_warm_x_recompute"] = res["ttft_l3_warm_s"] / res["ttft_recompute_s"]
    for ref in ("disk_write", "lmdb_put"):
        if "l3_write_gbps" in res and f"{ref}_gbps" in res:
            res[f"l3_write_over_{ref}"] = res["l3_write_gbps"] / res[f"{ref}_gbps"]


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["8b", "small"], default="8b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--l2-gb", type=float, default=None, help="L2 of the ttft engines, GiB (8b: 16, small: 1)")
    p.add_argument("--l3-gb", type=float, default=None, help="L3 (LMDB) capacity, GiB (8b: 48, small: 2)")
    p.add_argument("--read-threads", type=int, default=default_read_threads(),
                   help="the tier's reader threads, and the N of the raw LMDB read it is compared with")
    p.add_argument("--ceiling-gb", type=float, default=2.0)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--mt-l1-tokens", type=int, default=16384)
    p.add_argument("--mt-l2-gb", type=float, default=4.0)
    p.add_argument("--mt-user", type=int, default=256)
    p.add_argument("--mt-answer", type=int, default=32)
    p.add_argument("--mt-modes", default="serial,concurrent", help="comma list: serial,concurrent")
    p.add_argument("--eager", action="store_true", help="CUDA graphs and overlap scheduling off (a comparison)")
    p.add_argument("--l3-backends", default="lmdb",
                   help="comma list: lmdb (always) and mooncake (the ttft section's L3 warm hit and first "
                        "requests after a restart again on Mooncake Store; the H200 run uses lmdb,mooncake)")
    p.add_argument("--long-contexts", default=None,
                   help="comma list of context lengths of the longctx section (8b: 32768,102400; small: 2048,4096)")
    p.add_argument("--workdir", default=None, help="where the stores and the ceiling file go (local disk)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument("--skip", default="", help="comma list of sections to leave out")
    args = p.parse_args(argv)
    shape = LLAMA_8B if args.shape == "8b" else SMALL
    args.vocab = shape["vocab_size"]
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.shape_cfg = shape
    args.l2_gb = args.l2_gb if args.l2_gb is not None else (16.0 if args.shape == "8b" else 1.0)
    args.l3_gb = args.l3_gb if args.l3_gb is not None else (48.0 if args.shape == "8b" else 2.0)
    args.mt_modes = set(filter(None, args.mt_modes.split(",")))
    args.l3_backends = set(filter(None, args.l3_backends.split(",")))
    if "lmdb" not in args.l3_backends or args.l3_backends - {"lmdb", "mooncake"}:
        p.error("--l3-backends: lmdb, optionally with mooncake")
    long_default = "32768,102400" if args.shape == "8b" else "2048,4096"
    args.long_contexts = [int(c) for c in (args.long_contexts or long_default).split(",") if c]
    args.engine_init_s = []
    wanted = set(filter(None, args.sections.split(","))) - set(filter(None, args.skip.split(",")))
    unknown = wanted - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    res: dict = {"shape": args.shape, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "context_tokens": args.context,
                 "eager": args.eager, "sections": sorted(wanted), "section_s": {},
                 "l3_backends": sorted(args.l3_backends), "long_contexts": args.long_contexts,
                 "engine_init_s": args.engine_init_s}
    args.l2_pin_wait_s = res["l2_pin_wait_s"] = []  # per engine: waited for L2's background pinning
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="hicache-tiers-", dir=args.workdir)
    model_dir = os.path.join(work, "model")
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(shape, f)
    errors = []
    t_all = time.perf_counter()
    try:
        for name, fn in (("ceilings", lambda: ceilings(res, args, work)),
                         ("ttft", lambda: ttft_section(res, args, model_dir, work)),
                         ("longctx", lambda: long_section(res, args, model_dir, work)),
                         ("multiturn", lambda: multiturn_section(res, args, model_dir, work))):
            if name not in wanted:
                continue
            t0 = time.perf_counter()
            try:
                fn()
            except Exception:  # noqa: BLE001 - a failing section is reported; the others still run
                import traceback

                errors.append(traceback.format_exc())
                print(f"{name} FAILED:\n{errors[-1]}", flush=True)
            res["section_s"][name] = round(time.perf_counter() - t0, 1)
            print(f"section {name}: {res['section_s'][name]} s (engine start-ups so far: {args.engine_init_s})",
                  flush=True)
            write_json(args.json, {**res, "partial": True})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["total_s"] = round(time.perf_counter() - t_all, 1)
    ratios(res)
    res["goals"] = goals(res)
    if errors:
        res["errors"] = [e.splitlines()[-1] for e in errors]
    rows = [[k, v] for k, v in res.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    print_table(["what", "value"], rows)
    print_table(["goal", "met"], list(res["goals"].items()))
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
