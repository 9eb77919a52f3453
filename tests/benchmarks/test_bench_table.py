"""bench/common.print_table prints a table with no rows (a run whose sections all failed has no goals: its
table of goals must not hide the sections' errors behind a TypeError of its own). Run as the benchmarks run,
in a child process (tests never import bench)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _table(headers: list[str], rows: list[list]) -> list[str]:
    code = f"from bench.common import print_table; print_table({headers!r}, {rows!r})"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def test_a_table_without_rows_prints_its_headers():
    head, rule = _table(["goal", "met"], [])
    assert head.split() == ["goal", "met"]
    assert rule.split() == ["----", "---"]


def test_columns_are_as_wide_as_their_widest_cell():
    lines = _table(["what", "value"], [["context_tokens", 512], ["total_s", 1.7]])
    assert len({len(line.rstrip()) for line in lines[:2]}) == 1
    assert lines[2].startswith("context_tokens  512")
