"""Section 5 of bench/gpu.py: fp8 weights (``--quantization fp8``) on the Llama-3.1-8B shape.

The same dummy weights (seeded) are built twice, bf16 and fp8 (quantized at load, per output
channel; activations per token, ``torch._scaled_mm``), one engine at a time:
- logits agreement with bf16 on 4 prompts of 200 tokens (last-token logits: relative error and
  argmax agreement; with random weights the logits are nearly flat, so argmax agreement is a
  harsh test here and the relative error is the figure to read);
- decode tok/s at bs 1 and 64 (CUDA graphs + overlap, as the bf16 rows of section 3), and bs 1
  against fp8's own roofline: HBM copy bandwidth / bytes read per decode step (fp8 codes and
  scales of every projection and the LM head, the bf16 norms).
"""

from __future__ import annotations

import gc

import torch

from bench.gpu_model import LLAMA_8B, engine_decode, rand_prompts
from bench.gpu_sections import log


def _engine(model_dir: str, quantization: str):
    from serving.engine import Engine

    return Engine(model_path=model_dir, load_format="dummy", dtype="bfloat16", max_total_tokens=65536,
                  max_running_requests=64, chunked_prefill_size=8192, cuda_graph_max_bs=64,
                  quantization=quantization)


def _last_logits(eng, prompts: list[list[int]]) -> torch.Tensor:
    from serving.structs.forward_batch import ForwardBatch

    runner = eng.core.runner
    eng.flush_cache()
    per = -(-len(prompts[0]) // 16)
    pages = runner.pool.allocator.alloc(len(prompts) * per)
    fb = ForwardBatch.build([(ids, 0, pages[per * i: per * (i + 1)]) for i, ids in enumerate(prompts)], 16, "cuda")
    out = runner.forward(fb).float().clone()
    runner.pool.allocator.free(pages)
    return out


def _weight_bytes(model) -> int:
    """Bytes one decode step reads: quantized tensors of every QuantLinear (and the LM head's),
    the remaining parameters except the embedding table."""
    from serving.models.quant import QuantLinear

    seen: set[int] = set()
    total = 0
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)] + [model.logits_matmul.__self__]
    for lin in linears:
        for t in lin.q.values():
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    for name, p in model.named_parameters():
        if name not in ("model.embed_tokens.weight", "lm_head.weight"):
            total += p.numel() * p.element_size()
    return total


def _shapes() -> list[tuple[str, int, int, int]]:
    """(name, N, K, uses per decode step) of the 8B shape's projections."""
    c = LLAMA_8B
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    return [("qkv", h + 2 * kv, h, layers), ("o", h, h, layers), ("gate_up", 2 * inter, h, layers),
            ("down", h, inter, layers), ("lm_head", c["vocab_size"], h, 1)]


def gemm_sweep(res: dict, checks: dict, quick: bool) -> None:
    """Tile configs of serving.kernels.fp8_gemm's GEMV (M = 1) on the 8B projections: pick the one
    with the least time per decode step (each shape weighted by its uses), install it, report its
    weight-read GB/s per shape beside torch._scaled_mm's (with the activation-quant kernel) at M = 1
    and 64 (the larger batches' path)."""
    import itertools

    from triton.testing import do_bench_cudagraph

    from serving.kernels import fp8_gemm
    from serving.kernels.fp8_quant import quantize_rows_fp8

    shapes = _shapes()
    # copies of each weight, >= 256 MB together, read in turn: every read comes from HBM, not L2
    copies = {name: [(torch.randn(n, k, device="cuda") * 0.02).to(torch.float8_e4m3fn)
                     for _ in range(-(-(256 << 20) // (n * k)))] for name, n, k, _ in shapes}
    weights = {name: c[0] for name, c in copies.items()}

    def timed(fn, name: str) -> float:
        """ms per call of ``fn(w)``, in a CUDA graph, over the copies of ``name``'s weight."""
        ws = copies[name]
        return do_bench_cudagraph(lambda: [fn(w) for w in ws], rep=20) / len(ws)

    wscale = {name: torch.rand(1, n, device="cuda") * 1e-3 + 1e-4 for name, n, _, _ in shapes}
    grid = [(bn, bk, w, st, False) for bn, bk, w, st in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8),
                                                                          (1, 3))]
    grid += [(bn, bk, 4, 3, True) for bn, bk in itertools.product((16, 32, 64), (256, 512))]
    grid += [(bn, 0, w, 1, False) for bn, w in itertools.product((1, 2, 4, 8), (4, 8))]  # one shot
    if quick:
        grid = grid[:4]
    xs = {name: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for name, _, k, _ in shapes}
    total = 0.0
    for name, n, k, uses in shapes:
        best = None
        for cfg in grid:
            try:
                t = timed(lambda w, x=xs[name], sc=wscale[name], c=cfg:
                          fp8_gemm.fp8_gemv(x, w, sc, torch.bfloat16, c), name)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                log(f"fp8 gemv config {cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        fp8_gemm.CONFIGS[(n, k)] = best[1]
        res[f"fp8_gemv_config_{name}"] = list(best[1])
        total += uses * best[0]
        log(f"fp8 gemv {name} [{n}x{k}]: config {best[1]}, {n * k / 1e6 / best[0]:.0f} GB/s")
    log(f"fp8 gemv: {total:.3f} ms of projections per step")
    rows = []
    for name, n, k, _ in shapes:
        w, sc = weights[name], wscale[name]
        gb = n * k / 1e6  # bytes / (t ms * 1e6) = GB/s
        for m in (1, 64):
            x = xs[name] if m == 1 else torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def scaled(w, x=x, sc=sc):
                xq, s = quantize_rows_fp8(x)
                return torch._scaled_mm(xq, w.t(), scale_a=s, scale_b=sc, out_dtype=torch.bfloat16)

            res[f"scaled_mm_m{m}_{name}_gbps"] = gb / timed(scaled, name)
            if m == 1:
                ours = fp8_gemm.fp8_gemv(x, w, sc, torch.bfloat16)
                ref = scaled(w)
                checks[f"fp8_gemv_{name}_rel_err_vs_scaled_mm"] = float(
                    (ours.float() - ref.float()).norm() / ref.float().norm())
                res[f"fp8_gemv_{name}_gbps"] = gb / timed(lambda w, x=x, sc=sc: fp8_gemm.fp8_gemv(
                    x, w, sc, torch.bfloat16), name)
        rows.append([f"fp8 weight read {name} [{n}x{k}]: GEMV M=1 / _scaled_mm M=1 / M=64", "GB/s",
                     f"{res[f'fp8_gemv_{name}_gbps']:.0f} / {res[f'scaled_mm_m1_{name}_gbps']:.0f} / "
                     f"{res[f'scaled_mm_m64_{name}_gbps']:.0f}"])
    res["_fp8_rows"] = rows


def fp8_section(res: dict, checks: dict, args, model_dir: str) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        log("fp8 section skipped: needs compute capability 8.9+")
        return
    vocab = LLAMA_8B["vocab_size"]
    cmp = rand_prompts(4, 200, vocab, 4)
    p1 = rand_prompts(1, args.prompt_len, vocab, 1)
    p64 = rand_prompts(64, args.prompt_len, vocab, 2)
    rows = []
    from serving.kernels.fp8_quant import quantize_rows_fp8
    from serving.models.quant.fp8 import quantize_rows_torch

    x = torch.randn(64, 14336, device="cuda", dtype=torch.bfloat16) * 3
    (qa, sa), (qb, sb) = quantize_rows_fp8(x), quantize_rows_torch(x)
    checks["fp8_fused_quant_equals_torch"] = bool(torch.equal(sa, sb) and torch.equal(qa.view(torch.uint8),
                                                                                     qb.view(torch.uint8)))
    gemm_sweep(res, checks, args.quick)
    gc.collect()
    torch.cuda.empty_cache()
    log("fp8: bf16 reference engine")
    eng = _engine(model_dir, "none")
    ref = _last_logits(eng, cmp)
    if "decode_bs1_tok_s" not in res:  # section 3 skipped: bf16 decode in this run
        res["decode_bs1_tok_s"], _ = engine_decode(eng, p1, args.new_tokens)
        res["decode_bs64_tok_s"], _ = engine_decode(eng, p64, args.new_tokens)
    eng.shutdown()
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    log("fp8: the fp8 engine (same dummy weights, quantized at load)")
    eng = _engine(model_dir, "fp8")
    ours = _last_logits(eng, cmp)
    checks["fp8_vs_bf16_logits_rel_err"] = float((ours - ref).norm() / ref.norm())
    checks["fp8_vs_bf16_argmax_agree"] = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    wb = _weight_bytes(eng.core.runner.model)
    res["fp8_weight_bytes_read_per_step"] = wb
    res["fp8_roofline_bs1_tok_s"] = res["hbm_copy_gbps"] * 1e9 / wb
    for bs, prompts in ((1, p1), (64, p64)):
        res[f"fp8_decode_bs{bs}_tok_s"], _ = engine_decode(eng, prompts, args.new_tokens)
        res[f"fp8_decode_bs{bs}_vs_bf16"] = res[f"fp8_decode_bs{bs}_tok_s"] / res[f"decode_bs{bs}_tok_s"]
        rows.append([f"fp8 decode bs {bs}", "tok/s", res[f"fp8_decode_bs{bs}_tok_s"]])
        rows.append([f"fp8 decode bs {bs} vs bf16", "x", res[f"fp8_decode_bs{bs}_vs_bf16"]])
    res["fp8_decode_bs1_vs_roofline"] = res["fp8_decode_bs1_tok_s"] / res["fp8_roofline_bs1_tok_s"]
    rows.insert(0, ["fp8 roofline bs 1 (HBM / fp8 weight bytes)", "tok/s", res["fp8_roofline_bs1_tok_s"]])
    rows.append(["fp8 decode bs 1 vs its roofline", "%", 100 * res["fp8_decode_bs1_vs_roofline"]])
    rows.append(["fp8 vs bf16 last-token logits rel err", "", checks["fp8_vs_bf16_logits_rel_err"]])
    log(f"fp8: {res['fp8_decode_bs1_tok_s']:.0f} tok/s bs 1 ({100 * res['fp8_decode_bs1_vs_roofline']:.0f} % of "
        f"{res['fp8_roofline_bs1_tok_s']:.0f}), {res['fp8_decode_bs64_tok_s']:.0f} tok/s bs 64; logits rel err "
        f"{checks['fp8_vs_bf16_logits_rel_err']:.3f}, argmax agree {checks['fp8_vs_bf16_argmax_agree']:.2f}")
    res["_fp8_rows"] = res.get("_fp8_rows", []) + rows
    eng.shutdown()
