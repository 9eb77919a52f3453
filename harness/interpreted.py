"""Run a GPU code path's CPU-side logic in a subprocess (the Triton interpreter).

Triton chooses between compiling and interpreting when ``@triton.jit`` decorates a function (and ``import
transformers`` already imports it), so ``TRITON_INTERPRET=1`` must be set before the process starts: a kernel
test file's Triton tests run in this process with CUDA or with it set (``TRITON_HERE``), else a test of the
file runs them in a child pytest (:func:`run_file_interpreted`) and they skip here (:func:`triton_module`).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from harness.kernel_cases import INTERPRET

ROOT = Path(__file__).resolve().parents[1]
TRITON_HERE = INTERPRET or torch.cuda.is_available()


def triton_module(name: str, runner: str) -> ModuleType:
    """A kernel test file's fixture: the Triton module ``name`` where its tests run in this process, else a
    skip that names ``runner`` (the file's test that runs them in a child)."""
    if not TRITON_HERE:
        pytest.skip(f"needs CUDA or TRITON_INTERPRET=1 at start; run by {runner}")
    pytest.importorskip("triton")
    return importlib.import_module(name)


def run_file_interpreted(path: str, keyword: str) -> None:
    """Run the tests of file ``path`` that ``keyword`` selects in a child pytest under the interpreter: all
    must pass, none skip. Skipped where they run in this process."""
    if TRITON_HERE:
        pytest.skip("the Triton tests run in this process")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", path, "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", "-k", keyword]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and " skipped" not in res.stdout, res.stdout[-3000:]


def run_interpreted(code: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # one intra-op thread, as the suite (tests/conftest.py)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                         cwd=ROOT)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-4000:] + res.stderr[-4000:]
    return res.stdout
