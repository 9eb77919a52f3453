"""A short request behind a long prompt in chunks: its time to first token, in forward passes and seconds.

    .venv/bin/python bench/prefill_fairness.py [--long-tokens 7801] [--chunk 2048] [--json out.json]

The offline engine's core on SmolLM2 (fp32 on a CPU): a long prompt is added and runs its first chunk;
then a short request arrives, and both run to the end. Reported: the short request's TTFT (forward
passes after its arrival, and seconds), its whole time, the long prompt's TTFT beside it and alone (what
sharing its chunks costs it), and whether every greedy output equals the same request run alone. Run at
two commits to compare schedulers (the JSON names the commit and the CPU).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import parser, print_table, write_json  # noqa: E402

G = {"temperature": 0, "ignore_eos": True}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(core, reqs_at: list[tuple[int, list[int], int]]) -> list[dict]:
    """Add request i (prompt, max new tokens) before pass ``at``; step until all finish. Returns per
    request: ``req``, ``arrived`` (monotonic), ``ttft_passes`` (passes from its arrival to its first
    token, that one included), ``ttft_s`` and ``done_s`` (from its arrival)."""
    out = [{"req": None} for _ in reqs_at]
    passes = 0
    while passes == 0 or any(o["req"] is None or not o["req"].finished for o in out):
        for o, (at, prompt, new) in zip(out, reqs_at, strict=True):
            if at == passes and o["req"] is None:
                o["req"] = core.make_request(input_ids=prompt, sampling_params={**G, "max_new_tokens": new})
                o["arrived"], o["at"] = time.monotonic(), passes
                core.add(o["req"])
        core.step()
        passes += 1
        for o in out:
            r = o["req"]
            if r is not None and r.output_ids and "ttft_passes" not in o:
                o["ttft_passes"], o["ttft_s"] = passes - o["at"], r.first_token_time - o["arrived"]
            if r is not None and r.finished and "done_s" not in o:
                o["done_s"] = time.monotonic() - o["arrived"]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model-path", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--long-tokens", type=int, default=7801)
    p.add_argument("--short-tokens", type=int, default=4)
    p.add_argument("--chunk", type=int, default=2048, help="chunked_prefill_size")
    p.add_argument("--short-new", type=int, default=16, help="the short request's max_new_tokens")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-alone", action="store_true", help="skip the long prompt alone (saves its prefill)")
    args = p.parse_args(argv)
    import torch

    from serving.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]  # a shared machine: its load says how far the seconds can be trusted
    eng = Engine(model_path=args.model_path, device="cpu", max_total_tokens=args.long_tokens + 4096,
                 chunked_prefill_size=args.chunk)
    core = eng.core
    rng = random.Random(0)
    vocab = core.runner.arch.vocab_size
    long_p = [rng.randrange(100, vocab - 100) for _ in range(args.long_tokens)]
    short_p = [rng.randrange(100, vocab - 100) for _ in range(args.short_tokens)]
    eng.generate(input_ids=short_p[:2] + [7], sampling_params={**G, "max_new_tokens": 2})  # warm-up
    eng.flush_cache()

    long_, short = run(core, [(0, long_p, 1), (1, short_p, args.short_new)])
    eng.flush_cache()
    (short_alone,) = run(core, [(0, short_p, args.short_new)])
    eng.flush_cache()
    long_alone = None
    if not args.no_alone:
        (long_alone,) = run(core, [(0, long_p, 1)])
        eng.flush_cache()
    chunk_s = None if long_alone is None else long_alone["ttft_s"] / -(-args.long_tokens // args.chunk)
    res = {
        "commit": commit(), "cpu": cpu_model(), "threads": torch.get_num_threads(),
        "loadavg_1m_start_end": [load0, os.getloadavg()[0]],
        "model": os.path.basename(args.model_path.rstrip("/")), "long_tokens": args.long_tokens,
        "short_tokens": args.short_tokens, "chunked_prefill_size": args.chunk, "short_new_tokens": args.short_new,
        "short_ttft_passes": short["ttft_passes"], "short_ttft_s": short["ttft_s"], "short_done_s": short["done_s"],
        "short_alone_ttft_s": short_alone["ttft_s"], "long_ttft_s": long_["ttft_s"],
        "long_alone_ttft_s": None if long_alone is None else long_alone["ttft_s"],
        "chunk_pass_s": chunk_s,  # the long prompt alone: its TTFT over its chunks
        "short_ttft_in_chunk_passes": None if chunk_s is None else short["ttft_s"] / chunk_s,
        "outputs_equal_alone": short["req"].output_ids == short_alone["req"].output_ids
        and (long_alone is None or long_["req"].output_ids == long_alone["req"].output_ids),
    }
    eng.shutdown()
    print(f"{res['model']} on {res['cpu']} ({res['threads']} threads, load {load0:.1f}), commit {res['commit']}: a "
          f"{args.short_tokens}-token request arrives after the first chunk of a {args.long_tokens}-token prompt")
    print_table(["what", "value"], [
        ["short TTFT (passes after it arrived)", res["short_ttft_passes"]],
        ["short TTFT (s)", res["short_ttft_s"]],
        ["short TTFT (in chunk passes of the long prompt alone)", res["short_ttft_in_chunk_passes"] or "-"],
        [f"short done, {args.short_new} tokens (s)", res["short_done_s"]],
        ["short alone TTFT (s)", res["short_alone_ttft_s"]],
        ["long TTFT beside it (s)", res["long_ttft_s"]],
        ["long alone TTFT (s)", res["long_alone_ttft_s"] if res["long_alone_ttft_s"] is not None else "-"],
        ["outputs equal run alone", res["outputs_equal_alone"]],
    ])
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
