"""bench/speculative.py --device cuda (split out to keep files small): on the Llama-3.1-8B shape
with dummy weights.

1. ``verify_cost``: one forward pass of a verification batch (every sequence: its last token +
   ``k`` drafts on top of a ``--prefix``-token cached prefix, logits of every position) against a
   decode step of the same sequences, k = 4, 8, 16 and batch 1, 16, median of CUDA-event timings
   (bf16, CUDA graphs as the engine captures them). ``verify_ms`` is the batch the engine runs:
   the extend "row" graphs replay it up to 128 tokens x 16 sequences (``graphed``), beyond that
   it runs eagerly; ``verify_last_ms`` the same tokens asking only each sequence's last row (the
   plain extend graphs, ``graphed_last``): what the extra logit rows cost; ``ratio*`` over
   ``decode_ms``.
2. ``exact``: greedy outputs with speculation on equal plain decoding (``--exact-dtype``, default
   float32), first run and a regenerated run (drafted from the tree: long accepted runs).
3. ``regenerate``: decode tok/s of a regenerated answer (every draft accepted) on vs off, batch 1
   and 16, bf16: the end-to-end bound the verify cost allows.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from bench.common import print_table
from bench.gpu_model import LLAMA_8B, rand_prompts

SMALL = {**LLAMA_8B, "num_hidden_layers": 2, "hidden_size": 512, "intermediate_size": 1024,
         "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000}
KS = (4, 8, 16)
BATCHES = (1, 16)
PREFIX = 1024


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


DEVICE = "cuda"  # a CPU runs the same code for a smoke test (tests/benchmarks/test_speculative_bench.py)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def make_engine(model_dir: str, dtype: str, spec: bool, **kw):
    from serving.engine import Engine

    base = dict(model_path=model_dir, load_format="dummy", dtype=dtype, device=DEVICE, page_size=16,
                max_running_requests=16, max_total_tokens=65536)
    base.update(kw)
    if spec:
        base["speculative_algorithm"] = "NGRAM"
        base["speculative_num_draft_tokens"] = 17
    return Engine(**base)


def timed(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if DEVICE != "cuda":
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def verify_cost(eng, prefix: int) -> list[dict]:
    from serving.structs.forward_batch import ForwardBatch

    runner = eng.core.runner
    ps = runner.pool.page_size
    alloc = runner.pool.allocator
    per_seq = -(-(prefix + max(KS) + 1) // ps)
    rows = []
    for b in BATCHES:
        pages = alloc.alloc(per_seq * b)
        try:
            tables = [pages[i * per_seq:(i + 1) * per_seq] for i in range(b)]
            decode = ForwardBatch.build([([7], prefix, t) for t in tables], ps, runner.device)
            dec_ms = timed(lambda fb=decode: runner.forward(fb))
            for k in KS:
                full = ForwardBatch.build([([7] * (k + 1), prefix, t) for t in tables], ps, runner.device)
                full.logit_rows = torch.tensor([i * (k + 1) + j for i in range(b) for j in range(k)],
                                               device=runner.device)  # every position but the last rows
                last = ForwardBatch.build([([7] * (k + 1), prefix, t) for t in tables], ps, runner.device)
                graphs = runner.extend_graphs
                graphed, graphed_last = (graphs is not None and graphs.can_run(fb) for fb in (full, last))
                v_ms = timed(lambda fb=full: runner.forward(fb))
                g_ms = timed(lambda fb=last: runner.forward(fb))
                rows.append({"batch": b, "k": k, "tokens": b * (k + 1), "decode_ms": dec_ms, "verify_ms": v_ms,
                             "ratio": v_ms / dec_ms, "graphed": graphed, "verify_last_ms": g_ms,
                             "ratio_last": g_ms / dec_ms, "graphed_last": graphed_last})
                log(f"verify b{b} k{k}: {rows[-1]}")
        finally:
            alloc.free(pages)
    return rows


def decode_rate(eng, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]], dict]:
    core = eng.core
    reqs = [core.make_request(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": new,
                                                           "ignore_eos": True}) for p in prompts]
    for r in reqs:
        core.add(r)
    while not all(r.output_ids for r in reqs):
        core.step()
    sync()
    n0, t0 = sum(len(r.output_ids) for r in reqs), time.perf_counter()
    while not all(r.finished for r in reqs):
        core.step()
    sync()
    rate = (sum(len(r.output_ids) for r in reqs) - n0) / (time.perf_counter() - t0)
    acc = sum(r.spec.accepted for r in reqs if r.spec)
    ct = sum(r.spec.verify_ct for r in reqs if r.spec)
    return rate, [list(r.output_ids) for r in reqs], {"accept_length": (acc + ct) / ct if ct else 1.0}


def exactness(model_dir: str, dtype: str, vocab: int, n: int = 8, length: int = 300) -> dict:
    prompts = rand_prompts(n, length, vocab, seed=1) + [rand_prompts(1, 40, vocab, seed=2)[0] * 6]
    out = {}
    for spec in (False, True):
        eng = make_engine(model_dir, dtype, spec)
        first = decode_rate(eng, prompts, 64)[1]
        again = decode_rate(eng, prompts, 64)  # drafted from the tree on the speculative engine
        out[spec] = (first, again[1], again[2])
        eng.shutdown()
    same = out[True][0] == out[False][0] and out[True][1] == out[False][1]
    per = [a == b for a, b in zip(out[True][1], out[False][1], strict=True)]
    return {"dtype": dtype, "identical": same, "identical_prompts": sum(per), "prompts": len(per),
            "regenerated_accept_length": out[True][2]["accept_length"]}


def regenerate(model_dir: str, vocab: int, dtype: str = "bfloat16", new: int = 128) -> list[dict]:
    rows = []
    engines = {spec: make_engine(model_dir, dtype, spec) for spec in (False, True)}
    try:
        for b in BATCHES:
            prompts = rand_prompts(b, 512, vocab, seed=3 + b)
            rates = {}
            for spec, eng in engines.items():
                eng.flush_cache()
                decode_rate(eng, prompts, new)  # the first answer (into the tree)
                rates[spec] = decode_rate(eng, prompts, new)  # regenerated
            rows.append({"batch": b, "off_tok_s": rates[False][0], "on_tok_s": rates[True][0],
                         "speedup": rates[True][0] / rates[False][0], "accept_length": rates[True][2]["accept_length"],
                         "identical": rates[True][1] == rates[False][1]})
            log(f"regenerate b{b}: {rows[-1]}")
    finally:
        for eng in engines.values():
            eng.shutdown()
    return rows


def cuda_main(args) -> dict:
    shape = LLAMA_8B if args.shape == "8b" else SMALL
    res: dict = {"device": torch.cuda.get_device_name(), "shape": args.shape, "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d"), "prefix_tokens": PREFIX}
    work = tempfile.mkdtemp(prefix="hicache-spec-")
    model_dir = os.path.join(work, "model")
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(shape, f)
    try:
        eng = make_engine(model_dir, "bfloat16", True)
        res["verify_cost"] = verify_cost(eng, PREFIX)
        eng.shutdown()
        print_table(["batch", "k", "tokens", "decode ms", "verify ms", "x decode", "graphed", "last-rows ms",
                     "x decode", "graphed"],
                    [[r["batch"], r["k"], r["tokens"], r["decode_ms"], r["verify_ms"], r["ratio"], r["graphed"],
                      r["verify_last_ms"], r["ratio_last"], r["graphed_last"]] for r in res["verify_cost"]])
        res["exact"] = exactness(model_dir, args.exact_dtype, shape["vocab_size"])
        log(f"exact: {res['exact']}")
        res["regenerate"] = regenerate(model_dir, shape["vocab_size"])
        print_table(["batch", "off tok/s", "on tok/s", "x", "tok/verify", "identical"],
                    [[r["batch"], r["off_tok_s"], r["on_tok_s"], r["speedup"], r["accept_length"], r["identical"]]
                     for r in res["regenerate"]])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res
