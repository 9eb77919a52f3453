"""Sections 3-4 of bench/gpu.py (split out to keep files small): the Llama-3.1-8B shape with
random (dummy) bf16 weights against HF transformers, and multi-turn TTFT with L2 on vs L1 only.
See bench/gpu.py for what is measured and how.

Decode tok/s = ``bs * (M - 1) / (t(M new tokens) - t(1 new token))`` for the same prompts, so
prefill and warm-up cancel; the same formula for HF ``generate``. The roofline counts every
weight read per decode step (all but the embedding table).
"""

from __future__ import annotations

import gc
import random
import statistics
import time

import torch

from bench.gpu_sections import log, sync, wall_time

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "bos_token_id": 128000, "torch_dtype": "bfloat16",
}
GREEDY = {"temperature": 0, "ignore_eos": True}


# -- 3. the 8B shape ------------------------------------------------------------------------
def hf_state_dict(model, cfg) -> dict[str, torch.Tensor]:
    """Our fused parameters under HF's names (q/k/v and gate/up split back out)."""
    sd = {}
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    for name, p in model.named_parameters():
        if ".qkv_proj." in name:
            for piece, (a, b) in (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, q + 2 * kv))):
                sd[name.replace("qkv_proj", piece)] = p[a:b]
        elif ".gate_up_proj." in name:
            sd[name.replace("gate_up_proj", "gate_proj")] = p[:inter]
            sd[name.replace("gate_up_proj", "up_proj")] = p[inter:]
        else:
            sd[name] = p
    return sd


def rand_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1) for _ in range(length)] for _ in range(n)]


def engine_decode(eng, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """(decode tok/s, output ids) of ``eng`` on ``prompts`` (see the module doc)."""
    def run(m: int):
        eng.flush_cache()
        sync()
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": m})
        sync()
        assert all(len(o["output_ids"]) == m for o in outs)
        return time.perf_counter() - t0, [o["output_ids"] for o in outs]

    run(4)
    t1 = min(run(1)[0] for _ in range(2))
    tm, ids = run(new)
    return len(prompts) * (new - 1) / (tm - t1), ids


def hf_decode(hf, prompts: list[list[int]], new: int) -> float:
    x = torch.tensor(prompts, device="cuda")
    mask = torch.ones_like(x)

    def run(m: int) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=mask, max_new_tokens=m, min_new_tokens=m, do_sample=False,
                              pad_token_id=0)
        sync()
        assert out.shape[1] == x.shape[1] + m
        return time.perf_counter() - t0

    run(2)
    t1 = min(run(1) for _ in range(2))
    return len(prompts) * (new - 1) / (run(new) - t1)


def model_section(res: dict, checks: dict, args, model_dir: str) -> None:
    from serving.engine import Engine
    from serving.structs.forward_batch import ForwardBatch

    vocab = LLAMA_8B["vocab_size"]
    log("building the 8B-shape engine (dummy bf16 weights, CUDA graphs)")
    t0 = time.perf_counter()
    eng = Engine(model_path=model_dir, load_format="dummy", dtype="bfloat16", max_total_tokens=65536,
                 max_running_requests=64, chunked_prefill_size=8192, cuda_graph_max_bs=64)
    res["engine_start_s"] = time.perf_counter() - t0
    core = eng.core
    runner, sched = core.runner, core.scheduler
    model, arch = runner.model, runner.arch
    assert runner.graphs is not None and sched._overlap is not None
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if n != "model.embed_tokens.weight" or arch.tie_word_embeddings)
    res["weight_bytes_read_per_step"] = weight_bytes
    res["roofline_bs1_tok_s"] = res["hbm_copy_gbps"] * 1e9 / weight_bytes
    log(f"engine up in {res['engine_start_s']:.1f}s; {weight_bytes / 1e9:.2f} GB of weights read per decode step; "
        f"roofline {res['roofline_bs1_tok_s']:.0f} tok/s at bs 1")

    # graph replay vs eager on one decode batch (5 sequences, padded to 8)
    pages = runner.pool.allocator.alloc(5 * 9)
    seqs = [(rand_prompts(1, 130, vocab, 50 + i)[0], pages[9 * i: 9 * i + 9]) for i in range(5)]
    runner.forward(ForwardBatch.build([(ids, 0, p) for ids, p in seqs], 16, "cuda"))
    dec = ForwardBatch.build([([5 + i], 130, p) for i, (_, p) in enumerate(seqs)], 16, "cuda")
    kv = runner.pool.kv_buffer
    keep = kv[:, :, pages].clone()
    g_logits = runner.forward(dec).clone()
    kv[:, :, pages] = keep
    e_logits = runner._forward_eager(dec)
    checks["graph_vs_eager_logits_rel_err"] = float((g_logits - e_logits).norm() / e_logits.norm())
    runner.pool.allocator.free(pages)
    log(f"graph vs eager logits: rel err {checks['graph_vs_eager_logits_rel_err']:.2e}")

    # decode: CUDA graphs + overlap (default), then each switched off
    new = args.new_tokens
    p1 = rand_prompts(1, args.prompt_len, vocab, 1)
    p64 = rand_prompts(64, args.prompt_len, vocab, 2)
    rows = []
    graphs, overlap = runner.graphs, sched._overlap
    variants = [("graphs + overlap", graphs, overlap), ("graphs, no overlap", graphs, None),
                ("no graphs, overlap", None, overlap), ("no graphs, no overlap", None, None)]
    outs64 = {}
    for name, g, o in variants:
        runner.graphs, sched._overlap = g, o
        for bs, prompts in ((1, p1), (64, p64)):
            tok_s, ids = engine_decode(eng, prompts, new)
            key = name.replace(", ", "_").replace(" + ", "_").replace(" ", "_")
            res[f"decode_bs{bs}_{key}_tok_s"] = tok_s
            if bs == 64:
                outs64[name] = ids
            rows.append([f"hicache bs {bs}, {name}", tok_s])
            log(f"decode bs {bs} ({name}): {tok_s:.0f} tok/s")
    runner.graphs, sched._overlap = graphs, overlap
    res["decode_bs1_tok_s"] = res["decode_bs1_graphs_overlap_tok_s"]
    res["decode_bs64_tok_s"] = res["decode_bs64_graphs_overlap_tok_s"]
    res["decode_bs1_vs_roofline"] = res["decode_bs1_tok_s"] / res["roofline_bs1_tok_s"]
    checks["overlap_on_off_same_tokens_bs64"] = outs64["graphs + overlap"] == outs64["graphs, no overlap"]

    # prefill throughput: 16 prompts x 2048 tokens, one new token each
    pp = rand_prompts(16, 2048, vocab, 3)

    def prefill():
        eng.flush_cache()
        eng.generate(input_ids=pp, sampling_params={**GREEDY, "max_new_tokens": 1})

    t = wall_time(prefill, reps=3)
    res["prefill_tok_s"] = 16 * 2048 / t
    log(f"prefill: {res['prefill_tok_s']:.0f} tok/s")

    # HF transformers on the same weights
    hf_rows = []
    if not args.skip_hf:
        from transformers import LlamaConfig, LlamaForCausalLM

        log("building HF LlamaForCausalLM with our weights")
        hf_cfg = LlamaConfig.from_pretrained(model_dir)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                hf = LlamaForCausalLM(hf_cfg)
        finally:
            torch.set_default_dtype(prev)
        missing, unexpected = hf.load_state_dict(hf_state_dict(model, arch), strict=False)
        checks["hf_state_dict_missing"] = list(missing)
        checks["hf_state_dict_unexpected"] = list(unexpected)
        hf.eval()
        # same weights -> same logits (bf16): last-token logits of 4 prompts
        cmp = rand_prompts(4, 200, vocab, 4)
        eng.flush_cache()
        pages = runner.pool.allocator.alloc(4 * 13)
        fb = ForwardBatch.build([(ids, 0, pages[13 * i: 13 * i + 13]) for i, ids in enumerate(cmp)], 16, "cuda")
        ours = runner.forward(fb).float()
        runner.pool.allocator.free(pages)
        with torch.inference_mode():
            theirs = hf(torch.tensor(cmp, device="cuda")).logits[:, -1].float()
        checks["hf_logits_rel_err_bf16"] = float((ours - theirs).norm() / theirs.norm())
        checks["hf_argmax_agree"] = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
        log(f"ours vs HF logits: rel err {checks['hf_logits_rel_err_bf16']:.2e}, "
            f"argmax agree {checks['hf_argmax_agree']:.2f}")
        res["hf_bs64_tok_s"] = hf_decode(hf, p64, new)
        log(f"HF generate bs 64: {res['hf_bs64_tok_s']:.0f} tok/s")
        res["hf_bs1_tok_s"] = hf_decode(hf, p1, min(new, 64))
        log(f"HF generate bs 1: {res['hf_bs1_tok_s']:.0f} tok/s")
        hf_rows = [["HF generate bs 1", res["hf_bs1_tok_s"]], ["HF generate bs 64", res["hf_bs64_tok_s"]]]
        res["decode_bs64_vs_hf"] = res["decode_bs64_tok_s"] / res["hf_bs64_tok_s"]
        del hf
    res["_decode_rows"] = rows + hf_rows
    eng.shutdown()  # the engine's memory goes when this frame does (main collects)


# -- 4. multi-turn TTFT ---------------------------------------------------------------------
def multiturn(res: dict, args, model_dir: str) -> None:
    from serving.engine import Engine

    vocab = LLAMA_8B["vocab_size"]
    convs, turns, user, answer = args.conversations, args.turns, 512, 32
    out = {}
    for name, ratio in (("l2", 8.0), ("l1_only", 0.0)):
        eng = Engine(model_path=model_dir, load_format="dummy", dtype="bfloat16", max_total_tokens=args.l1_tokens,
                     hicache_ratio=ratio, max_running_requests=8, chunked_prefill_size=8192,
                     disable_cuda_graph=True, disable_overlap_schedule=True)  # TTFT = prefill + sample
        eng.generate(input_ids=rand_prompts(1, 600, vocab, 9)[0], sampling_params={**GREEDY, "max_new_tokens": 2})
        eng.flush_cache()
        hist = rand_prompts(convs, user, vocab, 10)
        rng = random.Random(11)
        ttft, host_hit, dev_hit = [], 0, 0
        for turn in range(turns):
            for c in range(convs):
                sync()
                t0 = time.perf_counter()
                o = eng.generate(input_ids=hist[c], sampling_params={**GREEDY, "max_new_tokens": 1})
                sync()
                dt = time.perf_counter() - t0
                if turn > 0:
                    ttft.append(dt)
                    host_hit += o["meta_info"]["cached_tokens_details"]["host"]
                    dev_hit += o["meta_info"]["cached_tokens_details"]["device"]
                hist[c] = hist[c] + o["output_ids"] + [rng.randrange(1000, vocab - 1) for _ in range(answer + user)]
        eng.check_integrity()
        out[name] = {"mean_ttft_s": statistics.mean(ttft), "p50_ttft_s": statistics.median(ttft),
                     "host_hit_tokens": host_hit, "device_hit_tokens": dev_hit,
                     "pages_loaded": eng.core.controller.pages_loaded if eng.core.controller else 0}
        log(f"multi-turn {name}: mean TTFT {1e3 * out[name]['mean_ttft_s']:.1f} ms, L2 hits {host_hit} tokens")
        eng.shutdown()
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    res["multiturn"] = {"conversations": convs, "turns": turns, "user_tokens": user, "answer_tokens": answer,
                        "l1_tokens": args.l1_tokens, **out}
    res["multiturn_ttft_l2_ms"] = 1e3 * out["l2"]["mean_ttft_s"]
    res["multiturn_ttft_l1_only_ms"] = 1e3 * out["l1_only"]["mean_ttft_s"]
    res["multiturn_ttft_speedup"] = out["l1_only"]["mean_ttft_s"] / out["l2"]["mean_ttft_s"]
