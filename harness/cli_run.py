"""Run the hicache command as a subprocess and check its one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness.server_utils import ROOT, free_port


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "serving.launch.cli", "serve", "--port", str(free_port()), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def assert_one_line(out: subprocess.CompletedProcess[str], *words: str) -> str:
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "Traceback" not in text and "persist" not in text and "loading the weights" not in text, text
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and not out.stdout.strip(), text
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def l3(path: Path | str, **extra) -> list[str]:
    return ["--config", "configs/l3.yaml", "--hicache-storage-backend-extra-config",
            json.dumps({"path": str(path), **extra})]
