"""docs/lang.md's serving.lang program runs as printed (only the server's address changed),
against a real server: on the tiny chat model (fast) and on SmolLM2 (slow, the printed output)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from harness.model_utils import smollm2_path
from harness.server_utils import ROOT, running_server


def readme_program() -> str:
    text = (ROOT / "docs" / "lang.md").read_text()
    section = text[text.index("# LLM programs (`serving.lang`)"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_program(url: str) -> list[str]:
    code = readme_program()
    assert code.count("http://127.0.0.1:30000") == 1
    out = subprocess.run([sys.executable, "-c", code.replace("http://127.0.0.1:30000", url)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "3/3" in out.stderr  # the progress bar
    return out.stdout.splitlines()


def check_output(lines: list[str]) -> tuple[str, list[int]]:
    details = ast.literal_eval(lines[-3])
    assert isinstance(details, list) and len(details) == 2
    level, cached = lines[-2].split(" ", 1)
    cached = ast.literal_eval(cached)
    assert level in ("beginners", "experts") and all(c >= 64 for c in cached), lines
    assert all(x in ("beginners", "experts") for x in ast.literal_eval(lines[-1]))
    return level, cached


def test_readme_program_tiny(lang_model) -> None:
    with running_server(["--model-path", str(lang_model), "--page-size", "16", "--max-total-tokens", "8192"]) as s:
        check_output(run_program(s.url))


@pytest.mark.slow
def test_readme_program_smollm2() -> None:
    # as `make serve` runs it (int4 weights, 16-token pages)
    with running_server(["--model-path", str(smollm2_path()), "--page-size", "16", "--quantization", "int4"]) as s:
        level, cached = check_output(run_program(s.url))
    assert level == "beginners" and cached == [64, 64]
