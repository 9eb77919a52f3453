"""Run a GPU code path's CPU-side logic in a subprocess (the Triton interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(code: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # one intra-op thread, as the suite (tests/conftest.py)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900,
                         cwd=ROOT)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-4000:] + res.stderr[-4000:]
    return res.stdout
