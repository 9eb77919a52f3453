"""bench/models.py runs end to end on CPU at its smoke size (--small: int8 for fp8) and writes the
numbers its table shows: so the H200 run (issue 45) does not fail on the bench itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_models_bench_smoke(tmp_path):
    out = tmp_path / "m.json"
    run = subprocess.run([sys.executable, "bench/models.py", "--small", "--device", "cpu", "--json", str(out),
                          "--models", "qwen3_30b_a3b,deepseek_v2_lite,llama_70b"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    moe, mla, dense = data["qwen3_30b_a3b"], data["deepseek_v2_lite"], data["llama_70b"]
    assert "error" not in moe and moe["decode_bs1_tok_s"] > 0 and 0 < moe["decode_bs64_of_roofline"] < 1
    assert moe["prefill_tok_s"] > 0
    assert "error" not in mla and ("mla" in mla or mla["kv_bytes_per_token_l1"] > 0), mla
    assert "error" not in dense and dense["quantization"] == "int8" and dense["decode_bs1_tok_s"] > 0
    assert dense["ttft_recompute_s"] > 0 and "ttft_l2_s" in dense, dense
