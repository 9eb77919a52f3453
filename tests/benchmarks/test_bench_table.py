"""bench/common.print_table prints a table with no rows (a run whose sections all failed has no goals: its
table of goals must not hide the sections' errors behind a TypeError of its own)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import print_table  # noqa: E402


def test_a_table_without_rows_prints_its_headers(capsys):
    print_table(["goal", "met"], [])
    head, rule = capsys.readouterr().out.splitlines()
    assert head.split() == ["goal", "met"]
    assert rule.split() == ["----", "---"]


def test_columns_are_as_wide_as_their_widest_cell(capsys):
    print_table(["what", "value"], [["context_tokens", 512], ["total_s", 1.7]])
    lines = capsys.readouterr().out.splitlines()
    assert len({len(line.rstrip()) for line in lines[:2]}) == 1
    assert lines[2].startswith("context_tokens  512")
