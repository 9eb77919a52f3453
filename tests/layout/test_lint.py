"""The code base stays ruff clean (rules in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    out = subprocess.run([ruff, "check", "hicache", "common", "edge", "serving", "router", "bench", "tests", "harness"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cache_core_imports_neither_serving_nor_router():
    for f in (ROOT / "hicache").rglob("*.py"):
        text = f.read_text()
        assert "import serving" not in text and "from serving" not in text, f
        assert "import router" not in text and "from router" not in text, f
