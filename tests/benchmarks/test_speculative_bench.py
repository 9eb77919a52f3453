"""bench/speculative.py's pieces on a CPU: the workloads' prompts, the goals, and the --device cuda
sections (verify cost, exactness, regenerate) run on a tiny shape with the CPU standing in."""

from __future__ import annotations

import json

from bench import speculative, speculative_gpu
from harness.model_utils import smollm2_path


def test_workloads_and_goals():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path()))
    code = speculative.code_prompts(tok, 8)
    assert len(code) == 8 and all(len(p) > 200 for p in code)
    assert tok.decode(code[0]).rstrip().endswith("```python")
    assert len(speculative.chat_prompts(tok, 8)) == 8
    assert speculative.serve_quantization() not in ("", None)
    runs = [{"batch": 1, "workload": "code", "quantization": "none", "speedup": 2.3},
            {"batch": 1, "workload": "chat", "quantization": "none", "speedup": 0.9},
            {"batch": 8, "workload": "chat", "quantization": "none", "speedup": 0.5}]
    assert speculative.goals(runs) == {"none_code_b1_x2.0": True, "none_chat_b1_x0.95": False}


def test_gpu_sections_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(speculative_gpu, "DEVICE", "cpu")
    monkeypatch.setattr(speculative_gpu, "BATCHES", (1, 2))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**speculative_gpu.SMALL, "vocab_size": 2048,
                                                   "hidden_size": 128, "intermediate_size": 256,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "head_dim": 32}))
    eng = speculative_gpu.make_engine(str(model), "float32", True, max_total_tokens=2048)
    rows = speculative_gpu.verify_cost(eng, 32)
    eng.shutdown()
    assert [(r["batch"], r["k"]) for r in rows] == [(b, k) for b in (1, 2) for k in speculative_gpu.KS]
    assert all(r["verify_ms"] > 0 and r["decode_ms"] > 0 and r["graphed"] is False for r in rows)
    assert all(r["verify_last_ms"] > 0 and r["graphed_last"] is False for r in rows)
    exact = speculative_gpu.exactness(str(model), "float32", 2048, n=2, length=40)
    assert exact["identical"], exact
    regen = speculative_gpu.regenerate(str(model), 2048, "float32", new=8)
    assert [r["batch"] for r in regen] == [1, 2] and all(r["identical"] for r in regen)
