"""Structured output: JSON decoding through the offline Engine with and without jump-forward,
and the grammar's cost per step (mask fill, join, apply, jump-forward checks) next to the
forward pass, in one run (same engine, grammars compiled once in a warm-up).

    .venv/bin/python bench/structured.py [--num-prompts 12] [--max-new-tokens 64] [--repeats 2] [--json out.json]

Rows: ``jump-forward`` and ``step-by-step`` (greedy, outputs must be identical), and
``unconstrained`` (the same prompts without a grammar, for the plain decoding speed).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, print_table, write_json  # noqa: E402

SCHEMAS = [
    ("Describe a person.", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "employed": {"type": "boolean"}}, "required": ["name", "age", "employed"]}),
    ("Classify the review 'Great phone, terrible battery'.", {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "mixed"]}, "confidence": {"enum": ["low", "medium", "high"]},
        "topic": {"type": "string", "maxLength": 16}}, "required": ["sentiment", "confidence", "topic"]}),
    ("Give the weather in Paris.", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "temperature_celsius": {"type": "integer", "minimum": -40,
                                                                             "maximum": 50},
        "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}},
        "required": ["city", "temperature_celsius", "condition"]}),
    ("Describe a book.", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 20}, "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
        "fiction": {"type": "boolean"}, "genre": {"enum": ["mystery", "romance", "science", "history"]}},
        "required": ["title", "pages", "fiction", "genre"]}),
]


def timed_forward(core):  # noqa: ANN001, ANN201
    """Wrap the scheduler's forward so the bench can read the time spent in it."""
    sched = core.scheduler
    inner = sched.forward
    box = {"s": 0.0}

    def forward(fb):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        out = inner(fb)
        box["s"] += time.perf_counter() - t
        return out

    sched.forward = forward
    return box


def run_mode(eng, prompts, params, fwd, jump: bool) -> tuple[dict, list]:  # noqa: ANN001
    core = eng.core
    g = core.grammar
    g.enable_jump_forward = jump
    s0 = dict(vars(g.stats))
    p0, f0 = core.scheduler.stats.forward_passes, fwd["s"]
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    wall = time.perf_counter() - t0
    d = {k: v - s0[k] for k, v in vars(g.stats).items()}
    steps = core.scheduler.stats.forward_passes - p0
    tokens = sum(len(o["output_ids"]) for o in outs)
    fwd_s = fwd["s"] - f0
    per = max(d["masked_steps"], 1)
    return {
        "wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall, "forward_passes": steps,
        "tokens_per_pass": tokens / max(steps, 1), "jumped_tokens": d["jumped_tokens"],
        "forward_ms_per_step": 1e3 * fwd_s / max(steps, 1),
        "fill_ms_per_step": 1e3 * d["fill_s"] / per,  # on the worker, overlapping the forward pass
        "join_wait_ms_per_step": 1e3 * d["wait_s"] / per,  # critical path
        "apply_ms_per_step": 1e3 * d["apply_s"] / per,  # critical path
        "jump_check_ms_per_step": 1e3 * d["jump_s"] / per,  # critical path
        "critical_path_overhead_pct": 100 * (d["wait_s"] + d["apply_s"] + d["jump_s"]) / max(fwd_s, 1e-9),
        "fill_vs_forward_pct": 100 * d["fill_s"] / max(fwd_s, 1e-9),
    }, outs


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model-path", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto", help="dummy: random weights (outputs still match the schemas)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved; the fastest is kept")
    args = p.parse_args()

    import json

    from serving.engine import Engine

    eng = Engine(model_path=args.model_path, device=args.device, load_format=args.load_format, max_total_tokens=16384)
    tok = eng.core.tokenizer
    items = [SCHEMAS[i % len(SCHEMAS)] for i in range(args.num_prompts)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"{q} Answer in JSON. (#{i})"}])
               for i, (q, _) in enumerate(items)]
    params = [{"temperature": 0, "max_new_tokens": args.max_new_tokens, "json_schema": s} for _, s in items]
    fwd = timed_forward(eng.core)
    eng.generate(prompts[: len(SCHEMAS)], params[: len(SCHEMAS)])  # warm-up: grammars compiled and cached
    eng.flush_cache()
    results, outputs = {}, {}
    plain = None
    for _ in range(args.repeats):  # modes interleaved; the fastest repeat of each is kept (shared machines)
        for name, jump in (("jump-forward", True), ("step-by-step", False), ("unconstrained", True)):
            eng.flush_cache()
            if name == "unconstrained":
                # the same prompts, each capped at its constrained length: the same tokens to decode
                plain = plain or [{"temperature": 0, "max_new_tokens": len(o["output_ids"]), "ignore_eos": True}
                                  for o in outputs["step-by-step"]]
                r, outs = run_mode(eng, prompts, plain, fwd, jump)
            else:
                r, outs = run_mode(eng, prompts, params, fwd, jump)
            if name not in results or r["wall_s"] < results[name]["wall_s"]:
                results[name], outputs[name] = r, outs
    identical = [o["output_ids"] for o in outputs["jump-forward"]] == [o["output_ids"] for o in outputs["step-by-step"]]
    valid = 0
    for o in outputs["jump-forward"]:
        try:
            json.loads(o["text"])
            valid += 1
        except ValueError:
            pass
    eng.shutdown()

    cols = ["tok_per_s", "output_tokens", "forward_passes", "tokens_per_pass", "jumped_tokens", "forward_ms_per_step",
            "fill_ms_per_step", "join_wait_ms_per_step", "apply_ms_per_step", "jump_check_ms_per_step",
            "critical_path_overhead_pct"]
    print(f"{args.num_prompts} JSON-schema prompts, greedy, batch of all, max_new_tokens={args.max_new_tokens}, "
          f"{args.model_path}")
    print_table(["mode", *cols], [[name, *(r[c] for c in cols)] for name, r in results.items()])
    speedup = results["jump-forward"]["tok_per_s"] / results["step-by-step"]["tok_per_s"]
    print(f"jump-forward vs step-by-step: {speedup:.2f}x tok/s; outputs identical: {identical}; "
          f"valid JSON: {valid}/{len(prompts)}")
    write_json(args.json, {"config": vars(args), "results": results, "jump_forward_speedup": speedup,
                           "outputs_identical": identical, "valid_json": valid})


if __name__ == "__main__":
    main()
