"""The GPU path in one run: correctness checks first, then the ceilings and our numbers.

    python3 bench/gpu.py [--json bench/results/gpu.json] [--quick]

1. ceilings: HBM device-to-device copy (bytes read + written), pinned host<->GPU copy per direction;
2. L1 <-> L2 page moves of scattered pages (one Triton kernel per move, both host layouts),
   after a round-trip check, beside the old staged path (gather + one copy + host scatter);
3. Llama-3.1-8B shape with random (dummy) bf16 weights, config.json written on the fly:
   HF transformers ``LlamaForCausalLM`` gets the same weights (copied from ours) and the
   logits are compared; decode tok/s at batch 1 and 64 with CUDA graphs and overlap
   scheduling, each switched off for A/B; HF ``generate`` at the same batch sizes;
   prefill throughput; the bs-1 roofline = HBM bandwidth / weight bytes read per token;
4. multi-turn TTFT through ``Engine`` with a small L1, L2 on (hicache_ratio) vs L1 only.

Decode tok/s = ``bs * (M - 1) / (t(M new tokens) - t(1 new token))`` for the same prompts, so
prefill and warm-up cancel; the same formula for HF ``generate``. Copies and page moves are
timed queued back to back between two CUDA events (sustained rate, as asynchronous moves run
in serving); ``*_single_gbps`` times one call at a time, the host's preparation included.
The roofline counts every weight read per decode step (all but the embedding table).
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402

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


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync() -> None:
    torch.cuda.synchronize()


def cuda_time(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``fn`` by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def queued_time(fn, reps: int = 10, warmup: int = 1) -> float:
    """Seconds per call of ``fn`` queued back to back (one event pair around all calls): the
    sustained rate of asynchronous moves, host overhead hidden behind the GPU as in serving."""
    for _ in range(warmup):
        fn()
    sync()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def wall_time(fn, reps: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- 1. ceilings ----------------------------------------------------------------------------
def ceilings(res: dict, quick: bool) -> None:
    n = (1 << 30) if not quick else (1 << 28)  # bytes
    a = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    t = cuda_time(lambda: b.copy_(a), reps=10)
    res["hbm_copy_gbps"] = 2 * n / t / 1e9  # read + write
    n = 512 << 20
    dev = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    host = torch.empty(n // 2, dtype=torch.bfloat16, pin_memory=True)
    res["pinned_d2h_gbps"] = n / queued_time(lambda: host.copy_(dev, non_blocking=True)) / 1e9
    res["pinned_h2d_gbps"] = n / queued_time(lambda: dev.copy_(host, non_blocking=True)) / 1e9
    res["copy_ceiling_gbps"] = (res["pinned_d2h_gbps"] + res["pinned_h2d_gbps"]) / 2
    log(f"HBM copy {res['hbm_copy_gbps']:.0f} GB/s; pinned D2H {res['pinned_d2h_gbps']:.1f}, "
        f"H2D {res['pinned_h2d_gbps']:.1f} GB/s")


# -- 2. page moves --------------------------------------------------------------------------
def page_moves(res: dict, checks: dict, quick: bool) -> None:
    from hicache.tiers.device import DeviceKVPool, KVLayout
    from hicache.tiers.host import make_host_pool
    from serving.kernels import page_copy_triton as pct
    from serving.kernels.page_copy import PageMover

    lay = KVLayout(32, 8, 128, torch.bfloat16)  # the 8B model's KV: 2 MiB per 16-token page
    ps, pool_pages, n = 16, 768, (256 if not quick else 64)
    pool = DeviceKVPool(lay, pool_pages, ps, "cuda")
    pool.kv_buffer.normal_()
    g = torch.Generator().manual_seed(0)
    src = torch.randperm(pool_pages, generator=g)[:n].tolist()
    dst = torch.randperm(pool_pages, generator=g)[:n].tolist()
    nbytes = n * pool.bytes_per_page
    res["page_move_pages"], res["page_move_bytes"] = n, nbytes
    flat = pool.kv_buffer.view(64, pool_pages, -1)
    # tune the kernel's block / warps on layer_first, both directions
    host = make_host_pool("layer_first", lay, pool_pages, ps)
    sid = torch.tensor(src, device="cuda")
    did = torch.tensor(dst, device="cuda")
    best, tune = None, []
    for block, warps in ((1024, 2), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16)):
        t_out = queued_time(lambda b=block, w=warps, h=host.buffer: pct.move_pages(flat, 1, sid, h, 1, did, b, w))
        t_in = queued_time(lambda b=block, w=warps, h=host.buffer: pct.move_pages(h, 1, did, flat, 1, sid, b, w))
        gbps = (nbytes / t_out + nbytes / t_in) / 2e9
        tune.append(f"{block}/{warps}: out {nbytes / t_out / 1e9:.1f} in {nbytes / t_in / 1e9:.1f}")
        if best is None or gbps > best[0]:
            best = (gbps, block, warps)
    log("page-move kernel block/warps -> GB/s: " + "; ".join(tune))
    pct.DEFAULT_BLOCK, pct.DEFAULT_WARPS = best[1], best[2]
    res["page_move_block"], res["page_move_warps"] = best[1], best[2]
    def one_layout(layout: str) -> bool:
        host = make_host_pool(layout, lay, pool_pages, ps)
        mover = PageMover(pool.kv_buffer, host)
        assert mover.use_kernel
        # correctness: out, then back into other pages
        mover.device_to_host(src, dst)
        mover.synchronize()
        good = torch.equal(host.read_pages(torch.tensor(dst[:32])), flat[:, src[:32]].cpu())
        taken = set(src)
        back = [p for p in range(pool_pages) if p not in taken]
        random.Random(1).shuffle(back)
        back = back[:n]
        mover.host_to_device(dst, back)
        good = good and torch.equal(flat[:, back], flat[:, src])

        def out():
            mover.device_to_host(src, dst)
            mover.synchronize()

        # moves queued back to back, timed by events on the model's stream like the ceiling: the
        # backup runs on the mover's stream, which the model's stream then waits for
        t_out = queued_time(lambda: mover.device_to_host(src, dst))
        t_in = queued_time(lambda: mover.host_to_device(dst, back, non_blocking=True))
        res[f"{layout}_backup_gbps"] = nbytes / t_out / 1e9
        res[f"{layout}_load_gbps"] = nbytes / t_in / 1e9
        # one call at a time (GPU idle while the host prepares each call)
        res[f"{layout}_backup_single_gbps"] = nbytes / cuda_time(lambda: mover.device_to_host(src, dst)) / 1e9
        res[f"{layout}_load_single_gbps"] = nbytes / cuda_time(
            lambda: mover.host_to_device(dst, back, non_blocking=True)) / 1e9
        # host wall time of a whole call, synchronized (Python and launch overhead included)
        res[f"{layout}_backup_wall_gbps"] = nbytes / wall_time(out) / 1e9
        res[f"{layout}_load_wall_gbps"] = nbytes / wall_time(lambda: mover.host_to_device(dst, back)) / 1e9
        # the previous path: device gather + one bulk copy + host-side scatter (fewer pages: slow)
        k = min(n, 64)
        old = PageMover(pool.kv_buffer, host, use_kernel=False)
        t_old_out = wall_time(lambda: old.device_to_host(src[:k], dst[:k]), reps=2)
        t_old_in = wall_time(lambda: old.host_to_device(dst[:k], back[:k]), reps=2)
        res[f"{layout}_staged_backup_gbps"] = k * pool.bytes_per_page / t_old_out / 1e9
        res[f"{layout}_staged_load_gbps"] = k * pool.bytes_per_page / t_old_in / 1e9
        return good

    ok = all([one_layout("layer_first"), one_layout("page_first")])
    checks["page_move_round_trip_exact"] = ok
    res["page_move_backup_gbps"] = res["layer_first_backup_gbps"]
    res["page_move_load_gbps"] = res["layer_first_load_gbps"]
    res["page_move_gbps"] = (res["page_move_backup_gbps"] + res["page_move_load_gbps"]) / 2
    res["page_move_backup_vs_d2h"] = res["page_move_backup_gbps"] / res["pinned_d2h_gbps"]
    res["page_move_load_vs_h2d"] = res["page_move_load_gbps"] / res["pinned_h2d_gbps"]
    res["page_move_vs_ceiling"] = res["page_move_gbps"] / res["copy_ceiling_gbps"]
    log(f"page moves: backup {res['page_move_backup_gbps']:.1f} GB/s, load {res['page_move_load_gbps']:.1f} GB/s "
        f"({100 * res['page_move_vs_ceiling']:.0f}% of the pinned ceiling); round trip exact: {ok}")


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
    from serving.forward_batch import ForwardBatch

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


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip", default="", help="comma list of sections to skip: moves,model,multiturn")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--l1-tokens", type=int, default=4096)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs CUDA")
    import triton

    skip = set(filter(None, args.skip.split(",")))
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "date": time.strftime("%Y-%m-%d")}
    checks: dict = {}
    errors = []

    def section(fn, *a) -> None:  # a failing section is reported; the others still run
        try:
            fn(*a)
        except Exception:  # noqa: BLE001
            import traceback

            errors.append(traceback.format_exc())
            log(f"{fn.__name__} FAILED:\n{errors[-1]}")
            gc.collect()
            torch.cuda.empty_cache()
        write_json(args.json, {**res, "checks": checks, "partial": True})  # survives a later timeout

    ceilings(res, args.quick)
    if "moves" not in skip:
        section(page_moves, res, checks, args.quick)
        gc.collect()
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(LLAMA_8B, f)
        if "model" not in skip:
            section(model_section, res, checks, args, d)
        gc.collect()
        torch.cuda.empty_cache()
        if "multiturn" not in skip:
            section(multiturn, res, args, d)
    res["checks"] = checks
    if errors:
        res["errors"] = [e.splitlines()[-1] for e in errors]
    rows = [["HBM copy (read+write)", "GB/s", res["hbm_copy_gbps"]],
            ["pinned copy D2H / H2D", "GB/s", f"{res['pinned_d2h_gbps']:.1f} / {res['pinned_h2d_gbps']:.1f}"],
            ["pinned copy ceiling (mean)", "GB/s", res["copy_ceiling_gbps"]]]
    if "page_move_gbps" in res:
        for lay in ("layer_first", "page_first"):
            rows.append([f"page move {lay} backup / load", "GB/s",
                         f"{res[f'{lay}_backup_gbps']:.1f} / {res[f'{lay}_load_gbps']:.1f}"])
            rows.append([f"  old staged path {lay} backup / load", "GB/s",
                         f"{res[f'{lay}_staged_backup_gbps']:.1f} / {res[f'{lay}_staged_load_gbps']:.1f}"])
        rows.append(["page move (mean) vs ceiling", "%", 100 * res["page_move_vs_ceiling"]])
    if "_decode_rows" in res:
        rows.append(["roofline bs 1 (HBM / weight bytes)", "tok/s", res["roofline_bs1_tok_s"]])
        rows += [[name, "tok/s", v] for name, v in res.pop("_decode_rows")]
        rows.append(["decode bs 1 vs roofline", "%", 100 * res["decode_bs1_vs_roofline"]])
        if "decode_bs64_vs_hf" in res:
            rows.append(["decode bs 64 vs HF generate", "x", res["decode_bs64_vs_hf"]])
        rows.append(["prefill (16 x 2048 tokens)", "tok/s", res["prefill_tok_s"]])
    if "multiturn" in res:
        rows.append(["multi-turn TTFT, L2 on", "ms", res["multiturn_ttft_l2_ms"]])
        rows.append(["multi-turn TTFT, L1 only", "ms", res["multiturn_ttft_l1_only_ms"]])
    print()
    print_table(["what", "unit", "value"], rows)
    print("checks:", json.dumps(checks))
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
