"""Hybrid models on the GPU (issue 43, Must show 3): Qwen3.5's default text config (the 9B-class
shape; Gated DeltaNet + gated attention) and Gemma-3 12B's text shape (5 sliding : 1 full), bf16
dummy weights, one run.

    python3 bench/hybrid.py [--json PATH] [--models qwen3_5,gemma3] [--sections decode,memory,ttft,multiturn]
        [--swa-full-tokens-ratio R]  # the hybrid SWA L1 (window pool) on, R of the logical pages
        [--small --device cpu]   # a smoke run: 4- / 6-layer shapes, short prompts

Per model:
1. decode: bs 1 and bs 64 step tok/s (1,024-token prompts; the offline Engine, its default
   graphs / overlap settings) against the HBM roofline (weights + each sequence's KV, a window
   layer its window, + its state read and written, over 4.1 TB/s);
2. memory: cached tokens per GB of L1 and of L2 for 8k-token sequences, computed from the model's
   own layouts and the engine's L1 pools: today's design (L1: every KV layer keeps every token, or
   with ``--swa-full-tokens-ratio R`` the hybrid SWA L1, its window layers R of the tokens; L2 likewise:
   every KV layer every token, or with R its host window pool's share; a request's end leaves up to two state snapshots:
   serving/cache/request_states.py), what the layer mix allows (full layers every token, window
   layers one window, one snapshot per end) and the same model with every layer full attention;
3. ttft: a returning 8k-token turn (an 8,128-token first turn, then it + its answer + 63 user
   tokens) served from L1, L2 (L1 demoted), L3 (a restarted engine) against recompute (fresh
   8,192-token prompts), each path warmed once untimed (its first hit compiles kernels: 2.2 s on the
   H200, bench/hybrid_hit_probe.py); a tier the engine does not hit is reported "n/a: <reason>";
4. multiturn: 16 conversations, concurrent turns (bench/gpu_tiers_sections.py's run), L1+L2+L3
   (L1+L2 where L3 is refused) vs L1 only, prompt tok/s.

State layers run fla-core's kernels on CUDA when it imports (serving/models/state_kernels.py;
``state_backend`` in the JSON), else the torch scan.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402
from bench.gpu_model import engine_decode, rand_prompts  # noqa: E402
from bench.gpu_tiers_sections import ONE, _multiturn_run, close, make_engine, sync, timed  # noqa: E402
from bench.hybrid_shapes import (  # noqa: E402
    decode_roofline,
    gemma3_config,
    layer_bytes,
    qwen3_5_config,
    tokens_per_gb,
    weight_bytes,
    write_model_dir,
)
from hicache.tiers.storage import default_read_threads  # noqa: E402

MODELS = {"qwen3_5": qwen3_5_config, "gemma3": gemma3_config}
SECTIONS = ("decode", "memory", "ttft", "multiturn")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def decode_and_memory(res: dict, args, model_dir: str, cfg: dict, sections: set[str]) -> None:
    eng = make_engine(args, model_dir, None, max_total_tokens=args.decode_tokens, max_running_requests=64,
                      **swa_kw(args))
    model = eng.core.runner.model
    lb = layer_bytes(model, cfg)
    res["layers"] = {k: (v if k != "windows" else sorted(set(v))) for k, v in lb.items()}
    res["windows_layers"] = len(lb["windows"])
    wb = weight_bytes(model)
    res["weight_bytes"] = wb
    if "memory" in sections:
        pool = eng.core.runner.pool
        share = pool.window_pages / pool.num_pages if pool.windows is not None else 1.0
        host = eng.core.host_pool  # its host window pool (hicache/tiers/host_windows.py), or every layer
        l2_share = host.windows.num_pages / host.num_pages if host is not None and host.windows is not None \
            else share if host is None and pool.windows is not None else 1.0
        res["memory"] = tokens_per_gb(lb, args.seq_len, snapshots_now=2 if lb["state_layers"] else 0,
                                      l1_window_share=share, l2_window_share=l2_share)
    if "decode" in sections:
        for bs in (1, 64):
            prompts = rand_prompts(bs, args.decode_ctx, cfg["vocab_size"], seed=bs)
            tok_s = engine_decode(eng, prompts, args.decode_steps)[0]
            roof = decode_roofline(wb, lb, bs, args.decode_ctx + args.decode_steps // 2)
            res[f"decode_bs{bs}_tok_s"] = tok_s
            res[f"decode_bs{bs}_roofline_tok_s"] = roof["roofline_tok_s"]
            res[f"decode_bs{bs}_of_roofline"] = tok_s / roof["roofline_tok_s"]
            res[f"decode_bs{bs}_step_bytes"] = roof["step_bytes"]
            log(f"decode bs {bs}: {tok_s:.1f} tok/s, roofline {roof['roofline_tok_s']:.1f}")
    close(eng)


def swa_kw(args) -> dict:
    """The engine's hybrid SWA L1 flags (``--swa-full-tokens-ratio R``: the window pool on, its size R
    of the logical pages; a model without sliding layers ignores them)."""
    if args.swa_full_tokens_ratio is None:
        return {}
    return dict(enable_hybrid_swa_memory=True, swa_full_tokens_ratio=args.swa_full_tokens_ratio)


def _returning(eng, first: list[int], more: list[int]) -> list[int]:
    out = eng.generate(input_ids=first, sampling_params=ONE)
    return first + out["output_ids"] + more


def ttft_section(res: dict, args, model_dir: str, cfg: dict, work: str) -> None:
    vocab, n, ctx = cfg["vocab_size"], args.prompts, args.ttft_ctx
    firsts = rand_prompts(3 * n, ctx - 64, vocab, seed=41)
    mores = rand_prompts(3 * n, 63, vocab, seed=42)
    fresh = rand_prompts(n, ctx, vocab, seed=43)
    l3 = os.path.join(work, "l3")
    kw = dict(max_total_tokens=(3 * n + 4) * (ctx + 64), hicache_size=args.l2_gb,
              hicache_storage_load_policy="always_load", **swa_kw(args))
    try:
        eng = make_engine(args, model_dir, l3, **kw)
    except Exception as e:  # noqa: BLE001 (the engine refuses L3 for this model: say why, go on without)
        res["ttft_l3"] = f"n/a: the engine refuses L3 ({type(e).__name__}: {str(e)[:200]})"
        l3 = None
        eng = make_engine(args, model_dir, None, **kw)
    for p in rand_prompts(2, 1024, vocab, seed=44):
        eng.generate(input_ids=p, sampling_params=ONE)
    res["ttft_recompute_s"] = statistics.median(timed(eng, p)[0] for p in fresh)
    details: dict[str, list] = {}

    def hit(name: str, prompt: list[int]) -> float:
        if eng.core.storage is not None:  # the user comes back once the earlier turns' L3 writes are done (their
            eng.core.storage.poll(wait=True)  # threads beside a launch-bound hit slow it: the GIL)
        storage = eng.core.storage if name == "l3" else None
        before = storage.stats() if storage is not None else {}
        dt, out = timed(eng, prompt)
        details.setdefault(name, []).append(out["meta_info"]["cached_tokens_details"])
        res.setdefault("ttft_times_s", {}).setdefault(name, []).append(round(dt, 4))
        if storage is not None:  # the hit's own L3 read: seconds inside the tier and bytes
            after = storage.stats()
            res.setdefault("ttft_l3_reads", []).append(
                {k: round(after.get(k, 0) - before.get(k, 0), 4) for k in ("read_s", "bytes_read", "hits")})
        return dt

    warm = rand_prompts(2, ctx - 64, vocab, seed=46), rand_prompts(2, 63, vocab, seed=47)
    eng.generate(input_ids=_returning(eng, warm[0][0], warm[1][0]), sampling_params=ONE)  # compiles, untimed
    rets = [_returning(eng, firsts[i], mores[i]) for i in range(n)]
    res["ttft_l1_s"] = statistics.median(hit("l1", r) for r in rets)
    r = _returning(eng, warm[0][1], warm[1][1])  # the L2 path's compiles (its load-back), untimed
    eng.core.tree.evict_device(eng.core.tree.cached_pages("device"))
    eng.core.req_cache.flush_transfers()
    eng.generate(input_ids=r, sampling_params=ONE)
    l2 = []
    for i in range(n, 2 * n):
        r = _returning(eng, firsts[i], mores[i])
        tree = eng.core.tree
        tree.evict_device(tree.cached_pages("device"))  # demote everything to L2
        eng.core.req_cache.flush_transfers()
        sync()
        l2.append(hit("l2", r))
    if sum(d.get("host", 0) for d in details["l2"]):
        res["ttft_l2_s"] = statistics.median(l2)
    else:  # L2 too small for the demoted prompts: they were recomputed
        res["ttft_l2"] = f"n/a: no tokens from L2 ({details['l2']}; TTFT {statistics.median(l2):.4f} s)"
    l3_rets = [_returning(eng, firsts[i], mores[i]) for i in range(2 * n, 3 * n)]
    close(eng, persist=l3 is not None)
    if l3 is not None:
        try:
            eng = make_engine(args, model_dir, l3, **kw)
            for p in rand_prompts(2, 1024, vocab, seed=45):
                eng.generate(input_ids=p, sampling_params=ONE)
            t3 = [hit("l3", r) for r in l3_rets]
            got = sum(d.get("storage", 0) for d in details["l3"])
            if got:
                res["ttft_l3_s"] = statistics.median(t3)
            else:
                res["ttft_l3"] = (f"n/a: the restarted engine served no tokens from L3 (cached tokens per tier "
                                  f"{details['l3']}; TTFT {statistics.median(t3):.4f} s)")
            close(eng)
        except Exception as e:  # noqa: BLE001
            res["ttft_l3"] = f"n/a: {type(e).__name__}: {str(e)[:200]}"
    if l3 is not None:
        shutil.rmtree(l3, ignore_errors=True)
    res["ttft_hits"] = details
    for k in ("l1", "l2", "l3"):
        if f"ttft_{k}_s" in res:
            res[f"ttft_{k}_vs_recompute"] = res[f"ttft_{k}_s"] / res["ttft_recompute_s"]
    log(f"ttft: {({k: v for k, v in res.items() if k.startswith('ttft_') and k != 'ttft_hits'})}")


def multiturn_section(res: dict, args, model_dir: str, cfg: dict, work: str) -> None:
    args.vocab = cfg["vocab_size"]
    out = {}
    l3 = os.path.join(work, "mt-l3")
    out["l1_only"] = _multiturn_run(args, model_dir, None, swa_kw(args), True)
    log(f"multiturn l1 only: {out['l1_only']}")
    try:
        out["l1_l2_l3"] = _multiturn_run(args, model_dir, l3, {"hicache_size": args.mt_l2_gb, **swa_kw(args)}, True)
    except Exception as e:  # noqa: BLE001
        out["l1_l2_l3_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out["l1_l2"] = _multiturn_run(args, model_dir, None, {"hicache_size": args.mt_l2_gb, **swa_kw(args)}, True)
    log(f"multiturn tiers: {out}")
    best = out.get("l1_l2_l3") or out.get("l1_l2")
    res["multiturn"] = {"conversations": args.conversations, "turns": args.turns, "context": args.context,
                        "l1_tokens": args.mt_l1_tokens, "l2_gb": args.mt_l2_gb, **out}
    res["multiturn_tiers_vs_l1"] = best["prompt_tok_s"] / out["l1_only"]["prompt_tok_s"]


def run_model(name: str, args, sections: set[str]) -> dict:
    from serving.models.state_kernels import backend_for

    cfg = MODELS[name](args.small)
    res: dict = {"shape": {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads", "num_key_value_heads", "head_dim",
                                                "vocab_size") if k in cfg}}
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"hybrid-{name}-", dir=args.workdir)
    model_dir = write_model_dir(os.path.join(work, "model"), cfg)
    res["state_backend"] = backend_for(torch.empty(0, device=args.device))
    t0 = time.perf_counter()
    try:
        if sections & {"decode", "memory"}:
            decode_and_memory(res, args, model_dir, cfg, sections)
        if "ttft" in sections:
            ttft_section(res, args, model_dir, cfg, work)
        if "multiturn" in sections:
            multiturn_section(res, args, model_dir, cfg, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def table(results: dict) -> None:
    rows = []
    for name, r in results.items():
        m = r.get("memory", {})

        def g(k, r=r):
            return r.get(k, "--")
        rows += [
            (name, "decode bs 1 tok/s (of roofline)", f"{g('decode_bs1_tok_s')} ({g('decode_bs1_of_roofline')})"),
            (name, "decode bs 64 tok/s (of roofline)", f"{g('decode_bs64_tok_s')} ({g('decode_bs64_of_roofline')})"),
            (name, "tokens/GB now / layer mix / all full", f"{m.get('tokens_per_gb_now', '--')} / "
             f"{m.get('tokens_per_gb_layer_mix', '--')} / {m.get('tokens_per_gb_all_full', '--')}"),
            (name, "L1 / L2 vs layer mix (goal >= 0.8)", f"{m.get('now_vs_layer_mix', '--')} / "
             f"{m.get('now_l2_vs_layer_mix', '--')}"),
            (name, "TTFT recompute / L1 / L2 / L3 s", f"{g('ttft_recompute_s')} / {g('ttft_l1_s')} / {g('ttft_l2_s')}"
             f" / {r.get('ttft_l3_s', r.get('ttft_l3', '--'))}"),
            (name, "TTFT L2 (when n/a)", r.get("ttft_l2", "--")),
            (name, "multiturn tiers vs L1 only (goal >= 3)", g("multiturn_tiers_vs_l1")),
        ]
    print_table(["model", "what", "value"], rows)


def main() -> None:
    p: argparse.ArgumentParser = parser(__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen3_5,gemma3")
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--small", action="store_true", help="tiny shapes and prompts (a smoke run; CPU works)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workdir", default=None)
    p.add_argument("--swa-full-tokens-ratio", type=float, default=None,
                   help="the hybrid SWA L1 on (the window pool), this share of the logical pages")
    for name, kind in (("conversations", int), ("context", int), ("mt_l1_tokens", int), ("mt_l2_gb", float)):
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help="multiturn: overrides the shape's")
    args = p.parse_args()
    s = args.small
    given = {k: getattr(args, k) for k in ("conversations", "context", "mt_l1_tokens", "mt_l2_gb")
             if getattr(args, k) is not None}
    args.__dict__.update(
        dtype="bfloat16" if args.device == "cuda" else "float32", eager=False, l3_gb=1.0 if s else 40.0,
        read_threads=default_read_threads(),  # the engine's own default (one per CPU, at most 16)
        engine_init_s=[], decode_ctx=64 if s else 1024, decode_steps=8 if s else 32, decode_tokens=8192 if s else 80000,
        seq_len=8192, ttft_ctx=512 if s else 8192, prompts=2 if s else 3, l2_gb=0.25 if s else 32.0,
        conversations=4 if s else 16, turns=3, context=128 if s else 4096, mt_l1_tokens=2048 if s else 16384,
        mt_l2_gb=0.1 if s else 4.0, mt_user=32 if s else 256, mt_answer=8 if s else 32)
    args.__dict__.update(given)
    sections = set(args.sections.split(","))
    results = {}
    for name in args.models.split(","):
        log(f"model {name}")
        results[name] = run_model(name, args, sections)
        write_json(args.json, {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                               "engine_init_s": args.engine_init_s, **results})
    table(results)


if __name__ == "__main__":
    main()
