"""CPU decode and prefill speed and accuracy of each ``--quantization`` mode, against HF
transformers fp32 and llama.cpp (llama-cpp-python, the optional ``bench-cpu`` extra:
``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install -e '.[bench-cpu]'``) on the very GGUF file ``make setup``
converts, in one run, with the CPU's flags and the C++ variant in use recorded.

    .venv/bin/python bench/cpu_decode.py [--modes none,int8,int4] [--repeats 3] [--json PATH]
    .venv/bin/python bench/cpu_decode.py --prefill-only --threads 1 --prefill-repeats 5  # prefill rows only

Decode tok/s: a chat prompt (batch 1) or 8 different ones (batch 8), greedy, ``ignore_eos``;
the time of ``1 + N`` new tokens minus the time of 1 new token (so prefill is not counted),
with the prefix cache flushed before each; ``--repeats`` samples, the median reported (min and
max beside it: on a shared machine the spread is the noise). llama-cpp-python's high-level API
decodes one sequence, so llama.cpp has no batch-8 figure. Prefill tok/s: one prompt of
``--prefill-tokens`` tokens (TEXT repeated), one new token, the cache flushed; every mode's engine
is loaded at once and the samples are taken in rounds, one per mode per round, so a busy moment
of a shared machine falls on every mode alike; each mode's best sample is reported beside the
median (``prefill_best_tok_s``: the least disturbed run). ``--prefill-only`` times only that (no
decode, no HF or llama.cpp speed rows).

Accuracy on TEXT (the opening paragraph of Dickens' *A Tale of Two Cities*, 1859, public domain),
teacher-forced: perplexity, and top-1 agreement with HF transformers fp32 (the share of positions
whose argmax next token is the same). ``paris``: whether the mode's greedy answer to the README's
first question ("What is the capital of France?", 32 tokens) names Paris -- the rule for the
default mode (serving/models/quant/auto.py), whose row is marked ``default``.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402

MODEL = "models/SmolLM2-135M-Instruct"
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way--in short, the period was so far like the present period, that some of its "
    "noisiest authorities insisted on its being received, for good or for evil, in the superlative degree "
    "of comparison only."
)
QUESTIONS = ["What is the capital of France?", "Explain photosynthesis in one sentence.",
             "Name three prime numbers.", "Write a haiku about the sea.", "What does a CPU do?",
             "Give me a synonym for happy.", "How many legs does a spider have?", "What is 12 times 7?"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def chat_ids(tok, n: int) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(n)]


def score(logits: torch.Tensor, ids: list[int], ref_top1: torch.Tensor | None) -> dict:
    """Perplexity of ids[1:] under logits[:-1]; top-1 agreement with ``ref_top1``."""
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item()
    top1 = logits[:-1].argmax(-1)
    agree = None if ref_top1 is None else (top1 == ref_top1).float().mean().item()
    return {"perplexity": math.exp(nll), "top1_agreement": agree, "top1": top1}


def cpu_info() -> dict:
    from serving.kernels import cpu_ext

    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    flags = cpu_ext.cpu_flags()
    keep = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx_vnni")
    # an instruction-set cap set for this run (the kernels' variant, torch's, MKL's, oneDNN's): a run on
    # an AVX-512 CPU capped at AVX2 says so here, with what llama.cpp was built for
    caps = ("HICACHE_CPU_KERNELS", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
    info = {"model_name": name, "nproc": os.cpu_count(), "flags": [f for f in keep if f in flags],
            "variants_runnable": [v.name for v in cpu_ext.runnable()], "variant_in_use": cpu_ext.variant(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "isa_caps": {k: os.environ[k] for k in caps if k in os.environ}}
    try:
        import llama_cpp

        info["llama_cpp_system_info"] = llama_cpp.llama_print_system_info().decode().strip()
    except ImportError:
        pass
    return info


def ours_logits(mode: str, ids: list[int]) -> torch.Tensor:
    """``[T, vocab]`` logits of our model in ``mode`` over ``ids`` in one prefill, through the attention
    backend (and so the fused C++ decoder) the engine uses on this machine."""
    from hicache.tiers.device import DeviceKVPool
    from serving.kernels.attention import get_attention_backend
    from serving.kernels.cpu_ext import extension
    from serving.models.loader import load_model
    from serving.structs.forward_batch import ForwardBatch

    model, cfg = load_model(MODEL, quantization=mode)
    page = 16
    pages = -(-len(ids) // page)
    pool = DeviceKVPool(cfg.kv_layout(torch.float32), pages + 1, page, "cpu")
    batch = ForwardBatch.build([(ids, 0, list(range(1, pages + 1)))], page)
    batch.logit_rows = torch.arange(len(ids))
    with torch.inference_mode():
        return model(batch, pool, get_attention_backend("cpu" if extension() else "torch"))[1:]


def register_fp8_emulated() -> str:
    """``fp8`` (W8A8 e4m3, per-channel weights, per-token activations) emulated in float32 on the
    CPU, for its accuracy on SmolLM2's real weights (the H200 bench has random weights only):
    the codes and scales of serving.models.quant.fp8, products and sums in float32."""
    from serving.models.quant import base
    from serving.models.quant.fp8 import Fp8W8A8, quantize_rows_torch

    class Fp8Emulated(Fp8W8A8):
        name = "fp8-emulated"
        devices = ("cpu",)

        def check_device(self, device: torch.device) -> None:
            base.QuantMethod.check_device(self, device)

        def matmul(self, x: torch.Tensor, q: dict[str, torch.Tensor]) -> torch.Tensor:
            xq, xs = quantize_rows_torch(x)
            return ((xq.float() @ q["codes"].float().t()) * xs * q["scale"]).to(x.dtype)

    if Fp8Emulated.name not in base.quant_methods():
        base.register_quant(Fp8Emulated)
    return Fp8Emulated.name


def stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "samples": samples}


def ours_engine(mode: str, tok, args) -> dict:
    """Decode (bs 1, bs 8), prefill and the README's first answer of one engine in ``mode``."""
    from serving.engine import Engine

    eng = Engine(model_path=MODEL, quantization=mode, max_total_tokens=max(8192, args.prefill_tokens + 64))
    greedy = {"temperature": 0, "ignore_eos": True}
    try:
        def gen(prompts):
            return lambda k: eng.generate(input_ids=prompts, sampling_params={**greedy, "max_new_tokens": k})

        bs1 = gen(chat_ids(tok, 1))
        out = {} if args.prefill_only else {
            "decode_bs1": stats(_timed_decode(bs1, eng.flush_cache, 1, args.new_tokens, args.repeats))}
        if mode in args.bs8_modes.split(",") and not args.prefill_only:
            out["decode_bs8"] = stats(_timed_decode(gen(chat_ids(tok, 8)), eng.flush_cache, 8, args.new_tokens,
                                                    args.repeats))
        answer = eng.generate(input_ids=chat_ids(tok, 1), sampling_params={"temperature": 0, "max_new_tokens": 32})
        out["answer"] = answer[0]["text"]
        return out
    finally:
        eng.shutdown()


def interleaved_prefill(modes: list[str], tok, args) -> dict[str, dict]:
    """Prefill samples of every mode, taken in rounds (see the module docstring)."""
    from serving.engine import Engine

    long = (tok(TEXT)["input_ids"] * (args.prefill_tokens // 100 + 1))[: args.prefill_tokens]
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 1}
    engines = {}
    try:
        for mode in modes:
            engines[mode] = Engine(model_path=MODEL, quantization=mode,
                                   max_total_tokens=max(8192, args.prefill_tokens + 64))
            engines[mode].generate(input_ids=[long[:64]], sampling_params=params)  # warm-up: one-off costs
        samples: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.prefill_repeats):
            for mode, eng in engines.items():
                eng.flush_cache()
                t0 = time.perf_counter()
                eng.generate(input_ids=[long], sampling_params=params)
                samples[mode].append(len(long) / (time.perf_counter() - t0))
        return {m: stats(v) for m, v in samples.items()}
    finally:
        for eng in engines.values():
            eng.shutdown()


def _timed_decode(gen, flush, batch: int, n: int, repeats: int) -> list[float]:
    """``repeats`` samples of batch * n / (t(1 + n new) - t(1 new))."""
    gen(2)
    samples = []
    for _ in range(repeats):
        flush()
        t0 = time.perf_counter()
        gen(1)
        t1 = time.perf_counter()
        flush()
        gen(1 + n)
        t2 = time.perf_counter()
        samples.append(batch * n / max((t2 - t1) - (t1 - t0), 1e-9))
    return samples


def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def hf_decode(model, tok, prompts: list[list[int]], n: int, repeats: int) -> list[float]:
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def gen(k: int) -> None:
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                           pad_token_id=pad)

    return _timed_decode(gen, lambda: None, len(prompts), n, repeats)


def llama_cpp():
    """(Llama class, GGUF path) or (None, reason)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, "llama.cpp: not installed (pip install -e '.[bench-cpu]')"
    from serving.convert import smollm2_gguf_path

    return Llama, str(smollm2_gguf_path())


def llama_rows(Llama, gguf: str, ids: list[int], prompt: list[int], tok, args) -> tuple[torch.Tensor, dict]:
    import numpy as np

    threads = torch.get_num_threads()
    llm = Llama(model_path=gguf, n_ctx=max(1024, args.prefill_tokens + 64), n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False)
    llm.reset()
    llm.eval(ids)
    logits = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))

    def greedy(n: int) -> list[int]:
        llm.reset()
        llm.eval(prompt)
        out = [int(np.argmax(llm.scores[llm.n_tokens - 1]))]
        for _ in range(n - 1):
            llm.eval([out[-1]])
            out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        return out

    samples = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        greedy(1)
        t1 = time.perf_counter()
        greedy(1 + args.new_tokens)
        t2 = time.perf_counter()
        samples.append(args.new_tokens / max((t2 - t1) - (t1 - t0), 1e-9))
    long = (tok(TEXT)["input_ids"] * (args.prefill_tokens // 100 + 1))[: args.prefill_tokens]
    prefill = []
    for _ in range(args.prefill_repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(long)
        prefill.append(len(long) / (time.perf_counter() - t0))
    answer = tok.decode(greedy(32), skip_special_tokens=True)
    return logits, {"decode_bs1": stats(samples), "prefill": stats(prefill), "answer": answer}


def row(engine: str, mode: str, s: dict, res: dict) -> dict:
    med = {k: res[k]["median"] if k in res else None for k in ("decode_bs1", "decode_bs8", "prefill")}
    return {"engine": engine, "mode": mode, "perplexity": s["perplexity"], "top1_agreement": s["top1_agreement"],
            "decode_bs1_tok_s": med["decode_bs1"], "decode_bs8_tok_s": med["decode_bs8"],
            "prefill_tok_s": med["prefill"],
            "prefill_best_tok_s": res["prefill"]["max"] if "prefill" in res else None,
            "paris": "Paris" in res.get("answer", "") if "answer" in res else None,
            "answer": res.get("answer"), "samples": {k: v for k, v in res.items() if k != "answer"}}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--modes", default="none,int8,int4")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="decode samples per figure (the median is reported)")
    p.add_argument("--prefill-tokens", type=int, default=1024)
    p.add_argument("--prefill-repeats", type=int, default=2)
    p.add_argument("--bs8-modes", default="none,int8,int4", help="modes also timed at batch 8")
    p.add_argument("--threads", type=int, default=0,
                   help="torch and llama.cpp threads (0: torch's default); 1 is robust on a shared machine, "
                        "where 2 OpenMP threads wait for each other's time slices")
    p.add_argument("--skip-hf", action="store_true", help="no HF transformers speed rows (its accuracy stays)")
    p.add_argument("--prefill-only", action="store_true",
                   help="time prefill only: no decode (bs 1, bs 8), no HF or llama.cpp speed rows (accuracy stays)")
    p.add_argument("--no-fp8-accuracy", action="store_true",
                   help="skip the fp8 row (W8A8 e4m3 emulated in float32: accuracy on real weights, no speed)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from serving.models.quant.auto import resolve_quantization

    tok = AutoTokenizer.from_pretrained(MODEL)
    ids = tok(TEXT)["input_ids"]
    load0 = os.getloadavg()
    default_mode = resolve_quantization("auto", "cpu")
    hf = hf_model()
    with torch.inference_mode():
        ref = score(hf(torch.tensor([ids])).logits[0], ids, None)
    log(f"HF fp32: perplexity {ref['perplexity']:.3f}")
    hf_res = {} if args.skip_hf or args.prefill_only else {
        "decode_bs1": stats(hf_decode(hf, tok, chat_ids(tok, 1), args.new_tokens, args.repeats)),
        "decode_bs8": stats(hf_decode(hf, tok, chat_ids(tok, 8), args.new_tokens, args.repeats))}
    rows = [row("hf-transformers", "fp32", {**ref, "top1_agreement": 1.0}, hf_res)]
    del hf
    modes = args.modes.split(",")
    prefill = interleaved_prefill(modes, tok, args)
    for mode in modes:
        s = score(ours_logits(mode, ids), ids, ref["top1"])
        rows.append(row("hicache", mode, s, {**ours_engine(mode, tok, args), "prefill": prefill[mode]}))
        rows[-1]["default"] = mode == default_mode
        log(f"hicache {mode}: " + ", ".join(f"{k} {rows[-1][k]}" for k in ("decode_bs1_tok_s", "decode_bs8_tok_s",
                                                                           "prefill_tok_s", "perplexity", "paris")))
    if not args.no_fp8_accuracy:  # accuracy only: no CPU fp8 kernel to time
        s = score(ours_logits(register_fp8_emulated(), ids), ids, ref["top1"])
        rows.append(row("hicache", "fp8 (emulated, accuracy only)", s, {}))
    Llama, gguf = (None, "llama.cpp: skipped (--prefill-only)") if args.prefill_only else llama_cpp()
    notes = []
    if Llama is None:
        notes.append(gguf)
        print(gguf)
    else:
        logits, res = llama_rows(Llama, gguf, ids, chat_ids(tok, 1)[0], tok, args)
        rows.append(row("llama.cpp", "gguf Q4_1/Q8_0", score(logits, ids, ref["top1"]), res))
    llama_bs1 = next((r["decode_bs1_tok_s"] for r in rows if r["engine"] == "llama.cpp"), None)
    fp32 = next((r for r in rows if r["engine"] == "hicache" and r["mode"] == "none"), {})
    fp32_prefill, fp32_best = fp32.get("prefill_tok_s"), fp32.get("prefill_best_tok_s")
    for r in rows:
        r["perplexity_delta_pct"] = 100 * (r["perplexity"] / ref["perplexity"] - 1)
        r["bs1_vs_llama_cpp"] = (None if llama_bs1 is None or r["decode_bs1_tok_s"] is None
                                 else r["decode_bs1_tok_s"] / llama_bs1)
        r["prefill_vs_fp32"] = (None if fp32_prefill is None or r["prefill_tok_s"] is None
                                else r["prefill_tok_s"] / fp32_prefill)
        r["prefill_best_vs_fp32"] = (None if fp32_best is None or r.get("prefill_best_tok_s") is None
                                     else r["prefill_best_tok_s"] / fp32_best)
    headers = ["engine", "mode", "decode_bs1_tok_s", "bs1_vs_llama_cpp", "decode_bs8_tok_s", "prefill_tok_s",
               "prefill_vs_fp32", "prefill_best_vs_fp32", "perplexity", "perplexity_delta_pct", "top1_agreement",
               "paris"]
    print_table(headers, [[r[h] if r.get(h) is not None else "-" for h in headers] for r in rows])
    cpu = cpu_info()
    print(f"text: {len(ids)} tokens; load average {load0} -> {os.getloadavg()}; torch threads "
          f"{torch.get_num_threads()}; CPU {cpu['model_name']} {cpu['flags']}, C++ variant {cpu['variant_in_use']}; "
          f"default mode {default_mode}")
    write_json(args.json, {"bench": "cpu_decode", "model": MODEL, "new_tokens": args.new_tokens,
                           "repeats": args.repeats, "prefill_tokens": args.prefill_tokens,
                           "prefill_repeats": args.prefill_repeats, "prefill_only": args.prefill_only,
                           "text_tokens": len(ids),
                           "text": TEXT, "torch_threads": torch.get_num_threads(), "cpu": cpu,
                           "default_mode": default_mode, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                           "notes": notes, "rows": rows})


if __name__ == "__main__":
    main()
