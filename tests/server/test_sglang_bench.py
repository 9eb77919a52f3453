"""SGLang's own benchmark client against a real server as `make serve` runs it: ``python -m sglang.bench_serving``
with ``--backend sglang`` (native /generate, which sends every GenerateReqInput field it knows
at its default) and ``--backend sglang-oai-chat`` must complete every request.

sglang is installed with ``pip install --no-deps sglang`` plus the few modules its import needs
(pyproject's ``test`` extras: msgspec, pyzmq, pybase64, sentencepiece, ipython,
compressed-tensors); torchvision is stubbed (tests/server/stubs/torchvision). Skipped, saying why,
where that import fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.model_utils import smollm2_path
from harness.server_utils import ROOT, running_server

STUBS = Path(__file__).resolve().parent / "stubs"
NUM_PROMPTS = 16


def _bench_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(STUBS), str(ROOT)]), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def _sglang_importable() -> str | None:
    r = subprocess.run([sys.executable, "-c", "import sglang.bench_serving"], env=_bench_env(),
                       capture_output=True, text=True, timeout=120)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """What `make serve` runs: configs/l3.yaml and SmolLM2 in int4 (with an L3 directory of its own)."""
    why = _sglang_importable()
    if why is not None:
        pytest.skip(f"sglang.bench_serving cannot be imported ({why}); install it with "
                    "`pip install --no-deps sglang` and the test extras")
    cfg = yaml.safe_load((ROOT / "configs" / "l3.yaml").read_text())
    tmp = tmp_path_factory.mktemp("bench-l3")
    cfg["cache"]["hicache_storage_backend_extra_config"]["path"] = str(tmp / "l3")
    (tmp / "l3.yaml").write_text(yaml.safe_dump(cfg))
    model = smollm2_path()
    with running_server(["--config", str(tmp / "l3.yaml"), "--model-path", str(model), "--quantization", "int4",
                         "--served-model-name", "tiny", "--max-total-tokens", "8192"]) as s:
        yield s, model


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sglang", "sglang-oai-chat"])
def test_bench_serving_completes_every_request(server, backend: str, tmp_path: Path) -> None:
    s, model = server
    out = tmp_path / "bench.jsonl"
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--base-url", s.url,
           "--model", "tiny", "--tokenizer", str(model), "--dataset-name", "random-ids",
           "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "32", "--random-output-len", "8",
           "--random-range-ratio", "1.0", "--request-rate", "inf", "--output-file", str(out),
           "--disable-tqdm", "--ready-check-timeout-sec", "0"]
    r = subprocess.run(cmd, env=_bench_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == NUM_PROMPTS, (result, r.stdout[-3000:])
    assert result["total_output_tokens"] == NUM_PROMPTS * 8  # ignore_eos: every request generates all 8
    assert s.check_integrity()["running"] == 0
