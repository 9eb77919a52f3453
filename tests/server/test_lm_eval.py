"""lm-evaluation-harness end to end: ``lm_eval --model local-completions`` scores a small
multiple-choice task through /v1/completions (echo + logprobs), and every loglikelihood it
reports agrees with HF transformers' for SmolLM2 (fp32). The task's data is local (no hub)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.model_utils import smollm2_path
from harness.server_utils import running_server

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Tokyo", "Cairo", "Lima"], 0),
    ("How many legs does a dog have?", ["two", "four", "six", "eight"], 1),
    ("What colour is the sky on a clear day?", ["green", "red", "blue", "black"], 2),
    ("Which animal says meow?", ["cow", "dog", "duck", "cat"], 3),
    ("What do bees make?", ["milk", "silk", "honey", "wool"], 2),
    ("What is frozen water called?", ["steam", "sand", "glass", "ice"], 3),
]
TASK = """task: hicache_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def hf_loglik(model, tok, context: str, continuation: str) -> float:
    import torch

    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return sum(lp[p - 1, whole[p]].item() for p in range(len(ctx), len(whole)))


@pytest.mark.slow
def test_lm_eval_local_completions(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    model = smollm2_path()
    with running_server(["--model-path", str(model), "--served-model-name", "smol", "--dtype", "float32",
                         "--page-size", "4", "--max-total-tokens", "4096", "--hicache-ratio", "0"]) as s:
        args = f"model=smol,base_url={s.url}/v1/completions,tokenizer={model},num_concurrent=2,max_retries=1"
        r = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
             "--tasks", "hicache_mc", "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out"),
             "--log_samples"],
            env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
            capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert s.check_integrity()["running"] == 0
    [samples] = glob.glob(str(tmp_path / "out" / "*" / "samples_hicache_mc_*.jsonl"))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in Path(samples).read_text().splitlines()]
    assert len(rows) == len(QUESTIONS)
    hf_acc = 0
    for row in rows:
        ctx = f"Question: {row['doc']['question']}\nAnswer:"
        got = [float(resp[0][0]) for resp in row["resps"]]
        want = [hf_loglik(hf, tok, ctx, " " + c) for c in row["doc"]["choices"]]
        assert got == pytest.approx(want, abs=1e-3), (row["doc"], got, want)
        hf_acc += max(range(len(want)), key=want.__getitem__) == row["doc"]["answer"]
        assert row["acc"] == float(max(range(len(got)), key=got.__getitem__) == row["doc"]["answer"])
    [results] = glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))
    acc = json.loads(Path(results).read_text())["results"]["hicache_mc"]["acc,none"]
    assert acc == pytest.approx(hf_acc / len(QUESTIONS)) and acc >= 0.5
