"""CPU decode speed and accuracy of each ``--quantization`` mode, against HF transformers fp32 and
llama.cpp (llama-cpp-python) on the very GGUF file ``make setup`` converts, in one run.

    .venv/bin/python bench/cpu_decode.py [--modes none,int8,int4] [--new-tokens 64] [--json PATH]

Decode tok/s: a chat prompt (batch 1) or 8 different ones (batch 8), greedy, ``ignore_eos``;
the time of ``1 + N`` new tokens minus the time of 1 new token (so prefill is not counted),
with the prefix cache flushed before each. llama-cpp-python's high-level API decodes one
sequence, so llama.cpp has no batch-8 figure.

Accuracy on TEXT (the opening paragraph of Dickens' *A Tale of Two Cities*, 1859, public domain),
teacher-forced: perplexity, and top-1 agreement with HF transformers fp32 (the share of positions
whose argmax next token is the same).
"""

from __future__ import annotations

import math
import os
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


def ours_logits(mode: str, ids: list[int]) -> torch.Tensor:
    """``[T, vocab]`` logits of our model in ``mode`` over ``ids`` in one prefill."""
    from hicache.tiers.device import DeviceKVPool
    from serving.forward_batch import ForwardBatch
    from serving.kernels.attention import get_attention_backend
    from serving.models.loader import load_model

    model, cfg = load_model(MODEL, quantization=mode)
    page = 16
    pages = -(-len(ids) // page)
    pool = DeviceKVPool(cfg.kv_layout(torch.float32), pages + 1, page, "cpu")
    batch = ForwardBatch.build([(ids, 0, list(range(1, pages + 1)))], page)
    batch.logit_rows = torch.arange(len(ids))
    with torch.inference_mode():
        return model(batch, pool, get_attention_backend("torch"))[1:]


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


def ours_decode(mode: str, prompts: list[list[int]], n: int) -> float:
    from serving.engine import Engine

    eng = Engine(model_path=MODEL, quantization=mode, max_total_tokens=8192)
    try:
        return _timed_decode(lambda k: eng.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": k, "ignore_eos": True}), eng.flush_cache, len(prompts), n)
    finally:
        eng.shutdown()


def _timed_decode(gen, flush, batch: int, n: int, repeats: int = 2) -> float:
    """Best of ``repeats``: batch * n / (t(1 + n new) - t(1 new))."""
    gen(2)
    best = 0.0
    for _ in range(repeats):
        flush()
        t0 = time.perf_counter()
        gen(1)
        t1 = time.perf_counter()
        flush()
        gen(1 + n)
        t2 = time.perf_counter()
        best = max(best, batch * n / max((t2 - t1) - (t1 - t0), 1e-9))
    return best


def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def hf_decode(model, tok, prompts: list[list[int]], n: int) -> float:
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def gen(k: int) -> None:
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                           pad_token_id=pad)

    return _timed_decode(gen, lambda: None, len(prompts), n)


def llama_cpp():
    """(Llama class, GGUF path) or (None, reason)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, "llama.cpp: not installed (pip install -e '.[bench-cpu]')"
    from serving.convert import smollm2_gguf_path

    return Llama, str(smollm2_gguf_path())


def llama_rows(Llama, gguf: str, ids: list[int], prompt: list[int], n: int) -> tuple[torch.Tensor, float]:
    import numpy as np

    threads = torch.get_num_threads()
    llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads, logits_all=True,
                verbose=False)
    llm.reset()
    llm.eval(ids)
    logits = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    best = 0.0
    for _ in range(2):
        llm.reset()
        llm.eval(prompt)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t0 = time.perf_counter()
        for _ in range(n):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        best = max(best, n / (time.perf_counter() - t0))
    return logits, best


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--modes", default="none,int8,int4")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--bs8-modes", default="none,int8,int4", help="modes also timed at batch 8")
    p.add_argument("--threads", type=int, default=0,
                   help="torch and llama.cpp threads (0: torch's default); 1 is robust on a shared machine, "
                        "where 2 OpenMP threads wait for each other's time slices")
    p.add_argument("--no-fp8-accuracy", action="store_true",
                   help="skip the fp8 row (W8A8 e4m3 emulated in float32: accuracy on real weights, no speed)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    ids = tok(TEXT)["input_ids"]
    one, eight = chat_ids(tok, 1), chat_ids(tok, 8)
    load0 = os.getloadavg()
    hf = hf_model()
    with torch.inference_mode():
        ref = score(hf(torch.tensor([ids])).logits[0], ids, None)
    log(f"HF fp32: perplexity {ref['perplexity']:.3f}")
    rows = [{"engine": "hf-transformers", "mode": "fp32", "perplexity": ref["perplexity"], "top1_agreement": 1.0,
             "decode_bs1_tok_s": hf_decode(hf, tok, one, args.new_tokens),
             "decode_bs8_tok_s": hf_decode(hf, tok, eight, args.new_tokens)}]
    del hf
    for mode in args.modes.split(","):
        s = score(ours_logits(mode, ids), ids, ref["top1"])
        rows.append({"engine": "hicache", "mode": mode, "perplexity": s["perplexity"],
                     "top1_agreement": s["top1_agreement"],
                     "decode_bs1_tok_s": ours_decode(mode, one, args.new_tokens),
                     "decode_bs8_tok_s": ours_decode(mode, eight, args.new_tokens)
                     if mode in args.bs8_modes.split(",") else None})
        log(f"hicache {mode}: {rows[-1]}")
    if not args.no_fp8_accuracy:  # accuracy only: no CPU fp8 kernel to time
        s = score(ours_logits(register_fp8_emulated(), ids), ids, ref["top1"])
        rows.append({"engine": "hicache", "mode": "fp8 (emulated, accuracy only)", "perplexity": s["perplexity"],
                     "top1_agreement": s["top1_agreement"], "decode_bs1_tok_s": None, "decode_bs8_tok_s": None})
    Llama, gguf = llama_cpp()
    notes = []
    if Llama is None:
        notes.append(gguf)
        print(gguf)
    else:
        logits, speed = llama_rows(Llama, gguf, ids, one[0], args.new_tokens)
        s = score(logits, ids, ref["top1"])
        rows.append({"engine": "llama.cpp", "mode": "gguf Q4_1/Q8_0", "perplexity": s["perplexity"],
                     "top1_agreement": s["top1_agreement"], "decode_bs1_tok_s": speed, "decode_bs8_tok_s": None})
    llama_bs1 = next((r["decode_bs1_tok_s"] for r in rows if r["engine"] == "llama.cpp"), None)
    for r in rows:
        r["perplexity_delta_pct"] = 100 * (r["perplexity"] / ref["perplexity"] - 1)
        r["bs1_vs_llama_cpp"] = (None if llama_bs1 is None or r["decode_bs1_tok_s"] is None
                                 else r["decode_bs1_tok_s"] / llama_bs1)
    headers = ["engine", "mode", "decode_bs1_tok_s", "decode_bs8_tok_s", "bs1_vs_llama_cpp", "perplexity",
               "perplexity_delta_pct", "top1_agreement"]
    print_table(headers, [[r[h] if r[h] is not None else "-" for h in headers] for r in rows])
    print(f"text: {len(ids)} tokens; load average {load0} -> {os.getloadavg()}; "
          f"torch threads {torch.get_num_threads()}")
    write_json(args.json, {"bench": "cpu_decode", "model": MODEL, "new_tokens": args.new_tokens,
                           "text_tokens": len(ids), "text": TEXT, "torch_threads": torch.get_num_threads(),
                           "loadavg_start": load0, "loadavg_end": os.getloadavg(), "notes": notes, "rows": rows})


if __name__ == "__main__":
    main()
