"""The models users deploy on the GPU (issue 45, Must show 2): one run, bf16 dummy weights.

    python3 bench/models.py [--json PATH] [--models qwen3_30b_a3b,deepseek_v2_lite,llama_70b]
        [--small --device cpu]   # a smoke run: 4-layer shapes, int8 for fp8 on a CPU

1. qwen3_30b_a3b (Qwen3-30B-A3B's shape, MoE: 128 experts, top 8): decode bs 1 / 64 tok/s against
   the roofline of the bytes a step reads (the weights outside the experts, the experts the batch's
   tokens pick: all k for one token, the expected distinct ones for 64, and each sequence's KV);
   prefill tok/s of one 8,192-token prompt;
2. deepseek_v2_lite (MLA + MoE): KV bytes per token on L1 and L2 (from the engine's pools) against
   a GQA layout of its heads; 16 conversations x 4k x 4 turns, concurrent turns, L1+L2+L3 against L1
   only (prompt tok/s); "n/a: <reason>" while the engine refuses the family;
3. llama_70b (Llama-3.1-70B's shape) with ``--quantization fp8``: it loads (seconds, peak GPU
   memory), decode bs 1 against the fp8 roofline, a returning 4k turn from L2 and from L3 against
   recompute (bench/hybrid.py's TTFT section).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402
from bench.gpu_model import engine_decode, rand_prompts  # noqa: E402
from bench.gpu_tiers_sections import _multiturn_run, close, make_engine, sync  # noqa: E402
from bench.hybrid import ttft_section  # noqa: E402
from bench.hybrid_shapes import write_model_dir  # noqa: E402
from bench.models_shapes import active_bytes, config, roofline  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def weight_bytes(model) -> int:
    """Parameter bytes one decode step may read (the embedding only as the LM head) and the
    quantized projections' codes."""
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    for m in model.modules():
        q = getattr(m, "q", None)
        if isinstance(q, dict):
            total += sum(t.numel() * t.element_size() for t in q.values() if isinstance(t, torch.Tensor))
    return total


def kv_bytes_per_token(eng) -> int:
    pool = eng.core.runner.pool
    return pool.nbytes() // (pool.num_pages * pool.page_size)


def decode(res: dict, args, eng, cfg: dict, elem: int) -> None:
    wb = weight_bytes(eng.core.runner.model)
    kvt = kv_bytes_per_token(eng)
    res["weight_bytes"], res["kv_bytes_per_token"] = wb, kvt
    for bs in (1, 64):
        ctx = args.decode_ctx + args.decode_steps // 2
        tok_s = engine_decode(eng, rand_prompts(bs, args.decode_ctx, cfg["vocab_size"], seed=bs), args.decode_steps)[0]
        roof = roofline(active_bytes(wb, cfg, bs, elem), kvt, bs, ctx)
        res[f"decode_bs{bs}_tok_s"] = tok_s
        res[f"decode_bs{bs}_roofline_tok_s"] = roof["roofline_tok_s"]
        res[f"decode_bs{bs}_of_roofline"] = tok_s / roof["roofline_tok_s"]
        log(f"decode bs {bs}: {tok_s:.1f} tok/s, roofline {roof['roofline_tok_s']:.1f}")


def prefill(res: dict, args, eng, cfg: dict) -> None:
    p = rand_prompts(1, args.prefill_tokens, cfg["vocab_size"], seed=99)
    eng.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 1})  # warm
    eng.flush_cache()
    p = rand_prompts(1, args.prefill_tokens, cfg["vocab_size"], seed=98)
    sync()
    t0 = time.perf_counter()
    eng.generate(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": 1})
    sync()
    res["prefill_tok_s"] = args.prefill_tokens / (time.perf_counter() - t0)


def moe_model(res: dict, args, model_dir: str, cfg: dict) -> None:
    eng = make_engine(args, model_dir, None, max_total_tokens=args.decode_tokens, max_running_requests=64)
    try:
        decode(res, args, eng, cfg, 2 if args.dtype == "bfloat16" else 4)
        prefill(res, args, eng, cfg)
    finally:
        close(eng)


def mla_model(res: dict, args, model_dir: str, cfg: dict, work: str) -> None:
    try:
        eng = make_engine(args, model_dir, None, max_total_tokens=args.mt_l1_tokens, hicache_size=args.mt_l2_gb)
    except Exception as e:  # noqa: BLE001 (a family the engine does not load yet: say why)
        res["mla"] = f"n/a: {type(e).__name__}: {str(e)[:300]}"
        return
    try:
        res["kv_bytes_per_token_l1"] = kv_bytes_per_token(eng)
        host = eng.core.host_pool
        res["kv_bytes_per_token_l2"] = host.nbytes() // (host.num_pages * host.page_size) if host else None
        elem = 2 if args.dtype == "bfloat16" else 4
        res["kv_bytes_per_token_gqa"] = 2 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * \
            (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) * elem
    finally:
        close(eng)
    args.vocab = cfg["vocab_size"]
    out = {"l1_only": _multiturn_run(args, model_dir, None, {}, True)}
    out["l1_l2_l3"] = _multiturn_run(args, model_dir, os.path.join(work, "mt-l3"), {"hicache_size": args.mt_l2_gb},
                                     True)
    res["multiturn"] = out
    res["multiturn_tiers_vs_l1"] = out["l1_l2_l3"]["prompt_tok_s"] / out["l1_only"]["prompt_tok_s"]


def fp8_model(res: dict, args, model_dir: str, cfg: dict, work: str) -> None:
    quant = "fp8" if args.device == "cuda" else "int8"
    res["quantization"] = quant
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    eng = make_engine(args, model_dir, None, quantization=quant, max_total_tokens=args.fp8_tokens,
                      max_running_requests=8)
    res["load_s"] = round(time.perf_counter() - t0, 1)
    if args.device == "cuda":
        res["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    try:
        wb = weight_bytes(eng.core.runner.model)
        kvt = kv_bytes_per_token(eng)
        res["weight_bytes"], res["kv_bytes_per_token"] = wb, kvt
        ctx = args.decode_ctx + args.decode_steps // 2
        tok_s = engine_decode(eng, rand_prompts(1, args.decode_ctx, cfg["vocab_size"], seed=1), args.decode_steps)[0]
        roof = roofline(wb, kvt, 1, ctx)
        res.update(decode_bs1_tok_s=tok_s, decode_bs1_roofline_tok_s=roof["roofline_tok_s"],
                   decode_bs1_of_roofline=tok_s / roof["roofline_tok_s"])
        log(f"loaded in {res['load_s']} s, peak {res.get('peak_gpu_gib', 0):.1f} GiB; decode bs 1: {tok_s:.1f} tok/s, "
            f"roofline {roof['roofline_tok_s']:.1f}")
    finally:
        close(eng)
    args.quantization = quant
    ttft_section(res, args, model_dir, cfg, work)


def run_model(name: str, args) -> dict:
    cfg = config(name, args.small)
    res: dict = {"shape": {k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "vocab_size")}}
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"models-{name}-", dir=args.workdir)
    model_dir = write_model_dir(os.path.join(work, "model"), cfg)
    t0 = time.perf_counter()
    try:
        if name == "qwen3_30b_a3b":
            moe_model(res, args, model_dir, cfg)
        elif name == "deepseek_v2_lite":
            mla_model(res, args, model_dir, cfg, work)
        else:
            fp8_model(res, args, model_dir, cfg, work)
    except Exception as e:  # noqa: BLE001 (one model's failure is reported, the others still run)
        res["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        log(f"{name}: {res['error']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def main() -> None:
    p: argparse.ArgumentParser = parser(__doc__.split("\n")[0])
    p.add_argument("--models", default="qwen3_30b_a3b,deepseek_v2_lite,llama_70b")
    p.add_argument("--small", action="store_true", help="4-layer shapes, short prompts (a smoke run; CPU works)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    s = args.small
    args.__dict__.update(
        dtype="bfloat16" if args.device == "cuda" else "float32", eager=False, read_threads=8, l3_gb=1.0 if s else 40.0,
        engine_init_s=[], decode_ctx=64 if s else 1024, decode_steps=8 if s else 32, decode_tokens=8192 if s else 80000,
        fp8_tokens=8192 if s else 32768,  # a 70B in fp8 leaves ~24 GiB of an H200 for KV (80k tokens: 24.4 GiB)
        prefill_tokens=256 if s else 8192, ttft_ctx=256 if s else 4096, prompts=2 if s else 3,
        l2_gb=0.25 if s else 32.0, conversations=4 if s else 16, turns=4, context=128 if s else 4096,
        mt_l1_tokens=2048 if s else 16384, mt_l2_gb=0.1 if s else 8.0, mt_user=32 if s else 256,
        mt_answer=8 if s else 32, swa_full_tokens_ratio=None)
    results = {}
    for name in args.models.split(","):
        log(f"model {name}")
        results[name] = run_model(name, args)
        write_json(args.json, {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                               "engine_init_s": args.engine_init_s, **results})
    rows = []
    for name, r in results.items():
        for k in ("decode_bs1_tok_s", "decode_bs1_of_roofline", "decode_bs64_tok_s", "decode_bs64_of_roofline",
                  "prefill_tok_s", "kv_bytes_per_token_l1", "kv_bytes_per_token_l2", "kv_bytes_per_token_gqa",
                  "multiturn_tiers_vs_l1", "load_s", "peak_gpu_gib", "ttft_recompute_s", "ttft_l2_s", "ttft_l3_s",
                  "ttft_l2_vs_recompute", "ttft_l3_vs_recompute", "mla", "error"):
            if k in r:
                rows.append((name, k, r[k]))
    print_table(["model", "what", "value"], rows)


if __name__ == "__main__":
    main()
