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
4. multi-turn TTFT through ``Engine`` with a small L1, L2 on (hicache_ratio) vs L1 only;
5. fp8 weights (``--quantization fp8``) on the 8B shape: decode bs 1 / 64 against bf16 in the same
   run and against fp8's own roofline, logits agreement with bf16 (bench/gpu_fp8.py).

Decode tok/s = ``bs * (M - 1) / (t(M new tokens) - t(1 new token))`` for the same prompts, so
prefill and warm-up cancel; the same formula for HF ``generate``. Copies and page moves are
timed queued back to back between two CUDA events (sustained rate, as asynchronous moves run
in serving); ``*_single_gbps`` times one call at a time, the host's preparation included.
The roofline counts every weight read per decode step (all but the embedding table).

Sections 1-2 live in bench/gpu_sections.py, sections 3-4 in bench/gpu_model.py, 5 in bench/gpu_fp8.py;
this file runs them.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import parser, print_table, write_json  # noqa: E402
from bench.gpu_fp8 import fp8_section  # noqa: E402
from bench.gpu_model import LLAMA_8B, model_section, multiturn  # noqa: E402
from bench.gpu_sections import ceilings, log, page_moves  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip", default="", help="comma list of sections to skip: moves,model,multiturn,fp8")
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
        gc.collect()
        torch.cuda.empty_cache()
        if "fp8" not in skip:
            section(fp8_section, res, checks, args, d)
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
    rows += res.pop("_fp8_rows", [])
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
