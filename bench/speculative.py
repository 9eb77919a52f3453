"""Speculative decoding (NGRAM, drafted from the HiRadixTree): decode tok/s with it on and off.

    .venv/bin/python bench/speculative.py [--modes none,serve] [--workloads code,agent,chat]
        [--batches 1,8] [--repeats 2] [--threads 1] [--json PATH]
    python bench/speculative.py --device cuda [--json PATH]      # the H200 (bench/speculative_gpu.py)

CPU (SmolLM2-135M; ``--modes``: ``none`` is fp32, ``serve`` is the ``make serve`` mode, the
Makefile's ``QUANTIZATION`` as ``--quantization`` resolves it): three workloads at batch 1 and 8,
greedy, each run once with speculation off and once on, ``--repeats`` times (off-on, on-off, ...):

- ``code``: prompt = a source file of this repository and "rename X to Y, reply with the whole
  file" (the answer opened with the code fence), so the answer is the file with one change;
- ``agent``: an agent loop: one tool-call JSON schema, 6 turns per conversation (the model's tool
  call, then a tool result), a session per conversation;
- ``chat``: open questions (little repetition).

Decode tok/s counts the tokens generated after every request of the batch has its first token
(prefill excluded) over that time. The speed-up is the ratio on/off within one repeat (the
machine may be loaded by others: ratios of neighbouring runs, the median over repeats); with the
acceptance rate and tokens per verify step (meta_info's spec_accept_rate / spec_accept_length)
and whether the outputs were identical. Goals: >= 2x on code and agent at batch 1, >= 0.95x on chat.

``--device cuda``: the verify step's cost against a decode step (k = 4, 8, 16 drafts; batch 1
and 16), greedy exactness on the 8B shape and the end-to-end speed of a regenerated answer
(bench/speculative_gpu.py).
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "models/SmolLM2-135M-Instruct"
FILES = ["serving/scheduler/stop.py", "serving/scheduler/schedule_policy.py", "hicache/hiradix/unbounded.py",
         "serving/server/session_ids.py", "serving/cache/kv_control_limits.py", "serving/runner/logprob_meta.py",
         "serving/server/text.py", "serving/engine/debug_hooks.py"]
QUESTIONS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
             "Explain how vaccines train the immune system.", "What are the pros and cons of remote work?",
             "Describe the water cycle to a ten year old.", "Give me ideas for a birthday party in winter.",
             "Why is the sky blue? Answer in detail.", "Compare cats and dogs as pets.",
             "Tell me about the history of the bicycle."]
SYSTEM = ("You are an agent that works on a code repository through tools. Reply to every message with exactly one "
          "tool call, a JSON object {\"tool\": NAME, \"arguments\": {...}}. Tools: list_files {\"path\": str}, "
          "read_file {\"path\": str, \"start\": int, \"end\": int}, search {\"query\": str, \"path\": str}, "
          "write_file {\"path\": str, \"content\": str}, run_tests {\"path\": str}.")
TASKS = ["find where the scheduler retracts requests and add a log line", "make the sampler reject top_p = 0",
         "add a test for stop strings", "rename the tree's lock method", "document the L3 prefetch policy",
         "speed up the page allocator", "fix a typo in the README", "add a flag for the session timeout"]
RESULTS = ["Tool result: cli.py config.py engine.py scheduler.py sampler.py stop.py request.py",
           "Tool result: serving/scheduler.py:300: def _retract(self, r: Req) -> None:",
           "Tool result: lines 290-320 shown", "Tool result: file written", "Tool result: 12 passed, 1 failed",
           "Tool result: serving/request.py:42: num_retractions: int = 0"]
TURNS = 6
NEW_TOKENS = {"code": 256, "agent": 64, "chat": 128}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def serve_quantization() -> str:
    """The Makefile's ``QUANTIZATION ?=`` (what ``make serve`` passes as --quantization)."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        m = re.search(r"^QUANTIZATION\s*\?=\s*(\S+)", f.read(), re.M)
    return m.group(1) if m else "none"


_SOURCES: dict[str, str] = {}


def source(path: str) -> str:
    """A file of FILES, read once per process (the off and on runs edit the same text even while the
    tree changes); a file moved since is found by its name under its top-level package."""
    if path not in _SOURCES:
        full = os.path.join(ROOT, path)
        if not os.path.exists(full):
            top, name = os.path.join(ROOT, path.split("/")[0]), os.path.basename(path)
            full = next(os.path.join(d, name) for d, _, fs in sorted(os.walk(top)) if name in fs)
        with open(full) as f:
            _SOURCES[path] = f.read()
    return _SOURCES[path]


def code_prompts(tok, n: int) -> list[list[int]]:
    out = []
    for path in (FILES * 2)[:n]:
        src = source(path)
        name = re.search(r"^(?:class|def) (\w+)", src, re.M).group(1)
        msg = [{"role": "user", "content": f"Here is a file:\n\n```python\n{src}```\n\nRename {name} to "
                                           f"{name}_v2. Reply with the complete updated file."}]
        text = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False) + "```python\n"
        out.append(tok(text)["input_ids"])
    return out


def chat_prompts(tok, n: int) -> list[list[int]]:
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in (QUESTIONS * 2)[:n]]


def decode_phase(core, reqs) -> tuple[int, float]:
    """Step until every request finished: (tokens generated after all had a first token, seconds)."""
    for r in reqs:
        core.add(r)
    while not all(r.output_ids or r.finished for r in reqs):
        core.step()
    n0, t0 = sum(len(r.output_ids) for r in reqs), time.perf_counter()
    while not all(r.finished for r in reqs):
        core.step()
    return sum(len(r.output_ids) for r in reqs) - n0, time.perf_counter() - t0


def run_flat(eng, prompts: list[list[int]], new: int) -> tuple[int, float, list]:
    core = eng.core
    reqs = [core.make_request(input_ids=p, sampling_params={"temperature": 0, "max_new_tokens": new})
            for p in prompts]
    n, t = decode_phase(core, reqs)
    return n, t, reqs


def run_agent(eng, tok, batch: int) -> tuple[int, float, list]:
    """``batch`` conversations side by side, TURNS turns each, a session per conversation."""
    import json

    core = eng.core
    convs = []
    for i in range(batch):
        sid = eng.open_session(f"agent-{i}-{time.monotonic_ns()}")
        first = {"tool": "list_files", "arguments": {"path": "serving"}}
        convs.append((sid, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task: {TASKS[i]}."},
                            {"role": "assistant", "content": json.dumps(first)},
                            {"role": "user", "content": RESULTS[0]}]))
    tokens, secs, done = 0, 0.0, []
    for turn in range(TURNS):
        reqs = [core.make_request(input_ids=tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                                    return_dict=False),
                                  sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS["agent"]},
                                  session_id=sid) for sid, msgs in convs]
        n, t = decode_phase(core, reqs)
        tokens, secs = tokens + n, secs + t
        for (_, msgs), r in zip(convs, reqs, strict=True):
            msgs += [{"role": "assistant", "content": tok.decode(r.output_ids, skip_special_tokens=True)},
                     {"role": "user", "content": RESULTS[(turn + 1) % len(RESULTS)]}]
        done += reqs
    for sid, _ in convs:
        eng.close_session(sid)
    return tokens, secs, done


def run(eng, tok, workload: str, batch: int) -> tuple[float, list]:
    eng.flush_cache()  # neither run drafts from the other's answers
    if workload == "agent":
        n, t, reqs = run_agent(eng, tok, batch)
    else:
        prompts = (code_prompts if workload == "code" else chat_prompts)(tok, batch)
        n, t, reqs = run_flat(eng, prompts, NEW_TOKENS[workload])
    return n / t, reqs


def spec_summary(reqs) -> dict:
    drafted = sum(r.spec.drafted for r in reqs if r.spec)
    acc = sum(r.spec.accepted for r in reqs if r.spec)
    ct = sum(r.spec.verify_ct for r in reqs if r.spec)
    return {"accept_rate": acc / drafted if drafted else 0.0, "accept_length": (acc + ct) / ct if ct else 1.0,
            "verify_steps": ct, "auto_off": sum(r.spec.auto_off for r in reqs if r.spec)}


def cpu_main(args) -> dict:
    from transformers import AutoTokenizer

    from serving.engine import Engine

    tok = AutoTokenizer.from_pretrained(MODEL)
    modes = [serve_quantization() if m == "serve" else m for m in args.modes.split(",")]
    res: dict = {"device": "cpu", "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
                 "load_average": os.getloadavg(), "serve_quantization": serve_quantization(), "runs": []}
    rows = []
    for mode in modes:
        kw = dict(model_path=MODEL, quantization=mode, max_total_tokens=16384)
        off, on = Engine(**kw), Engine(**kw, speculative_algorithm="NGRAM")
        for workload in args.workloads.split(","):
            for batch in [int(b) for b in args.batches.split(",")]:
                ratios, offs, ons, same, summ = [], [], [], True, []
                for rep in range(args.repeats):
                    if rep % 2 == 0:  # off-on, then on-off: a machine getting slower or faster favours neither
                        a, ra = run(off, tok, workload, batch)
                        b, rb = run(on, tok, workload, batch)
                    else:
                        b, rb = run(on, tok, workload, batch)
                        a, ra = run(off, tok, workload, batch)
                    same = same and [r.output_ids for r in ra] == [r.output_ids for r in rb]
                    offs.append(a)
                    ons.append(b)
                    ratios.append(b / a)
                    summ.append(spec_summary(rb))
                    log(f"{mode} {workload} b{batch} #{rep}: off {a:.1f} on {b:.1f} tok/s x{b / a:.2f} {summ[-1]}")
                row = {"quantization": mode, "workload": workload, "batch": batch,
                       "off_tok_s": statistics.median(offs), "on_tok_s": statistics.median(ons),
                       "speedup": statistics.median(ratios), "speedups": ratios, "identical": same,
                       "accept_rate": statistics.mean(s["accept_rate"] for s in summ),
                       "accept_length": statistics.mean(s["accept_length"] for s in summ),
                       "auto_off": sum(s["auto_off"] for s in summ)}
                res["runs"].append(row)
                rows.append([mode, workload, batch, row["off_tok_s"], row["on_tok_s"], row["speedup"],
                             row["accept_rate"], row["accept_length"], same])
                write_json(args.json, {**res, "partial": True})
        res.setdefault("engine_stats", {})[mode] = on.core.speculative.stats_dict()
        off.shutdown()
        on.shutdown()
    print_table(["quant", "workload", "batch", "off tok/s", "on tok/s", "x", "accept", "tok/verify", "identical"],
                rows)
    res["goals"] = goals(res["runs"])
    print("goals:", res["goals"])
    return res


def goals(runs: list[dict]) -> dict:
    out = {}
    for r in runs:
        if r["batch"] != 1:
            continue
        want = 0.95 if r["workload"] == "chat" else 2.0
        out[f"{r['quantization']}_{r['workload']}_b1_x{want}"] = r["speedup"] >= want
    return out


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--modes", default="none,serve", help="--quantization values; serve: the Makefile's")
    p.add_argument("--workloads", default="code,agent,chat")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: its default); 1 is robust on a shared machine, where two OpenMP "
                        "threads wait for each other's time slices")
    p.add_argument("--shape", default="8b", choices=["8b", "small"], help="--device cuda: the model shape")
    p.add_argument("--exact-dtype", default="float32", help="--device cuda: dtype of the exactness check")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        from bench.speculative_gpu import cuda_main

        res = cuda_main(args)
    else:
        res = cpu_main(args)
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
