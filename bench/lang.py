"""The frontend language vs naive requests: a few-shot program over a batch of inputs.

``serving.lang`` runs the program over the batch with ``run_batch`` (the shared few-shot header
computed once by the first program, the rest batched and hitting it); the baseline sends the
same prompts (the programs' own texts) one request at a time to ``/generate``, the cache
flushed before each (no reuse). Same server, same greedy sampling, one run; prints throughput
of both, the ratio, each side's cache hit rate (cached / prompt tokens) and whether the answers
are the same.

    .venv/bin/python bench/lang.py [--num-inputs 32] [--shots 24] [--max-new-tokens 16] [--json out.json]
    .venv/bin/python bench/lang.py --url http://127.0.0.1:30000   # a server already running
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

import serving.lang as sgl  # noqa: E402
from bench.common import parser, print_table, write_json  # noqa: E402

PAIRS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Canada", "Ottawa"), ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"), ("Brazil", "Brasilia"), ("India", "New Delhi"), ("China", "Beijing"),
    ("Russia", "Moscow"), ("Mexico", "Mexico City"), ("Turkey", "Ankara"), ("Iran", "Tehran"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Cuba", "Havana"), ("Nigeria", "Abuja"),
    ("Ghana", "Accra"), ("Iraq", "Baghdad"), ("Syria", "Damascus"), ("Nepal", "Kathmandu"),
    ("Israel", "Jerusalem"), ("Jordan", "Amman"), ("Qatar", "Doha"),
]
INPUTS = [
    "Germany", "Spain", "Portugal", "Norway", "Sweden", "Poland", "Greece", "Austria", "Belgium", "Ireland",
    "Finland", "Denmark", "Hungary", "Romania", "Peru", "Chile", "Argentina", "Colombia", "Venezuela",
    "Australia", "New Zealand", "Indonesia", "Malaysia", "Philippines", "South Korea", "Pakistan",
    "Bangladesh", "Morocco", "Algeria", "Ethiopia", "Ukraine", "Czech Republic",
]


def make_program(shots: int, max_new: int) -> sgl.SglFunction:
    header = "Answer each question with the capital city only.\n\n" + "".join(
        f"Question: What is the capital of {c}?\nAnswer: {a}\n\n" for c, a in PAIRS[:shots])

    @sgl.function
    def few_shot_qa(s, country):
        s += header + f"Question: What is the capital of {country}?\nAnswer:"
        s += sgl.gen("answer", max_tokens=max_new, stop="\n")

    return few_shot_qa


def run(url: str, n: int, shots: int, max_new: int) -> dict:
    backend = sgl.RuntimeEndpoint(url)
    program = make_program(shots, max_new)
    inputs = [{"country": INPUTS[i % len(INPUTS)]} for i in range(n)]
    program.run(**inputs[0], backend=backend, temperature=0)  # warm-up (first-request costs), then a cold cache
    backend.flush_cache()
    t0 = time.perf_counter()
    states = program.run_batch(inputs, backend=backend, temperature=0)
    lang_s = time.perf_counter() - t0
    metas = [s.get_meta_info("answer") for s in states]
    answers = [s["answer"] for s in states]
    prompts = [s.text()[: len(s.text()) - len(a)] for s, a in zip(states, answers, strict=True)]

    naive_s, naive_meta, naive_answers = 0.0, [], []
    with httpx.Client(base_url=url, timeout=600) as client:
        for prompt in prompts:
            assert client.post("/flush_cache").status_code == 200
            t0 = time.perf_counter()
            r = client.post("/generate", json={"text": prompt, "sampling_params": {
                "max_new_tokens": max_new, "stop": "\n", "temperature": 0}})
            naive_s += time.perf_counter() - t0
            r.raise_for_status()
            naive_meta.append(r.json()["meta_info"])
            naive_answers.append(r.json()["text"])
    backend.shutdown()

    def side(seconds: float, ms: list[dict]) -> dict:
        prompt = sum(m["prompt_tokens"] for m in ms)
        return {"seconds": seconds, "programs_per_s": n / seconds,
                "output_tokens_per_s": sum(m["completion_tokens"] for m in ms) / seconds,
                "prompt_tokens": prompt, "cached_tokens": sum(m["cached_tokens"] for m in ms),
                "hit_rate": sum(m["cached_tokens"] for m in ms) / prompt}

    lang, naive = side(lang_s, metas), side(naive_s, naive_meta)
    return {"num_inputs": n, "shots": shots, "max_new_tokens": max_new,
            "prompt_tokens_per_program": lang["prompt_tokens"] / n, "lang": lang, "naive": naive,
            "speedup": lang["programs_per_s"] / naive["programs_per_s"],
            "answers_equal": sum(a == b for a, b in zip(answers, naive_answers, strict=True))}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model-path", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--url", help="use this running server instead of starting one")
    p.add_argument("--num-inputs", type=int, default=32)
    p.add_argument("--shots", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--server-args", default="--page-size 16", help="extra flags for the server this starts")
    args = p.parse_args()
    server = None
    url = args.url
    if url is None:
        from harness.server_utils import ServerProcess

        server = ServerProcess(["--model-path", args.model_path, *args.server_args.split()])
        server.start(timeout=300)
        url = server.url
    try:
        out = run(url, args.num_inputs, args.shots, args.max_new_tokens)
    finally:
        if server is not None:
            server.stop()
    lang, naive = out["lang"], out["naive"]
    print(f"few-shot program: {args.shots} shots, {out['prompt_tokens_per_program']:.0f} prompt tokens per "
          f"program, {args.num_inputs} inputs, <= {args.max_new_tokens} new tokens each")
    print_table(["mode", "seconds", "programs/s", "output tok/s", "cache hit rate"], [
        ["serving.lang run_batch", lang["seconds"], lang["programs_per_s"], lang["output_tokens_per_s"],
         lang["hit_rate"]],
        ["naive, one at a time, flushed", naive["seconds"], naive["programs_per_s"], naive["output_tokens_per_s"],
         naive["hit_rate"]],
    ])
    print(f"speedup {out['speedup']:.2f}x; answers equal {out['answers_equal']}/{args.num_inputs}")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
