"""Offline throughput: N concurrent chat prompts through our Engine and through HF
transformers ``generate`` (one static, left-padded batch), same model, same run.

    .venv/bin/python bench/offline_throughput.py [--num-prompts 32] [--max-new-tokens 64] [--json out.json]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in one sentence.", "Name three prime numbers.",
    "Write a haiku about the sea.", "What does a CPU do?", "Give me a synonym for happy.",
    "How many legs does a spider have?", "What is 12 times 7?",
]


def chat_prompts(tokenizer, n: int) -> list[str]:
    system = "You are a concise, helpful assistant."
    return [tokenizer.apply_chat_template([{"role": "system", "content": system},
                                           {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}])
            for i in range(n)]


def run_ours(model_path: str, prompts: list[str], max_new: int, device: str) -> tuple[float, int]:
    from serving.engine import Engine

    eng = Engine(model_path=model_path, device=device, max_total_tokens=32768)
    eng.generate(prompts[0], {"temperature": 0, "max_new_tokens": 2})  # warm-up
    eng.flush_cache()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True})
    dt = time.perf_counter() - t0
    eng.shutdown()
    return dt, sum(len(o["output_ids"]) for o in outs)


def run_hf(model_path: str, prompts: list[str], max_new: int, device: str) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    with torch.inference_mode():
        model.generate(**batch, max_new_tokens=2, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
        dt = time.perf_counter() - t0
    return dt, int((out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0])


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model-path", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    from serving.tokenizer import Tokenizer

    prompts = chat_prompts(Tokenizer(args.model_path), args.num_prompts)
    ours_s, ours_tok = run_ours(args.model_path, prompts, args.max_new_tokens, args.device)
    hf_s, hf_tok = run_hf(args.model_path, prompts, args.max_new_tokens, args.device)
    res = {
        "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "device": args.device,
        "hicache_tok_s": ours_tok / ours_s, "hicache_s": ours_s,
        "hf_generate_tok_s": hf_tok / hf_s, "hf_generate_s": hf_s,
    }
    res["ratio"] = res["hicache_tok_s"] / res["hf_generate_tok_s"]
    print_table(["engine", "output tokens", "seconds", "tok/s"], [
        ["hicache Engine", ours_tok, ours_s, res["hicache_tok_s"]],
        ["HF generate (static batch)", hf_tok, hf_s, res["hf_generate_tok_s"]],
    ])
    print(f"ratio (hicache / HF): {res['ratio']:.2f}x")
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
