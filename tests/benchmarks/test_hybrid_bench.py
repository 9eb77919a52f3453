"""bench/hybrid.py runs end to end on CPU at its smoke size (--small) and its TTFT section hits every tier:
the returning prompts come back from L1, from L2 and, after a restart, from L3, for both families (the
smoke's prompts are longer than the L3 prefetch threshold: at 256 tokens the restarted engine recomputed
them and the L3 case printed n/a). So the H200 run (issue 43) does not fail on the bench itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_hybrid_bench_smoke_hits_every_tier(tmp_path):
    out = tmp_path / "h.json"
    run = subprocess.run([sys.executable, "bench/hybrid.py", "--small", "--device", "cpu", "--json", str(out),
                          "--sections", "memory,ttft"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    for model in ("qwen3_5", "gemma3"):
        res = data[model]
        assert res["memory"]["tokens_per_gb_now"] > 0
        for tier, key in (("l1", "device"), ("l2", "host"), ("l3", "storage")):
            assert f"ttft_{tier}_s" in res, (model, tier, res.get(f"ttft_{tier}"))
            assert all(hit[key] > 0 for hit in res["ttft_hits"][tier]), (model, tier, res["ttft_hits"][tier])


def test_multi_turn_probe_runs_and_reports_each_turn(tmp_path):
    """bench/hybrid_mt_probe.py at its CPU size (Gemma-3's small shape, the H200 run's proportions of L1, L2
    and conversations) runs and reports, per turn, what each request missed and the backups without their
    window. (How many returning conversations it recomputes whole depends on how far the L3 writes lag the
    prefill: none on an idle CPU, some beside another test worker; docs/benchmarks.md, the open defect.)"""
    out = tmp_path / "p.json"
    run = subprocess.run([sys.executable, "bench/hybrid_mt_probe.py", "--small", "--device", "cpu", "--json",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    turns = json.loads(out.read_text())["turns"]
    assert len(turns) == 3 and turns[0]["recomputed_whole"] == 16 and turns[0]["missed"] == [512] * 16
    assert all(len(t["missed"]) == 16 and t["host_window_not_kept"] is not None for t in turns)
    assert sum(t["recomputed_whole"] for t in turns[1:]) < 32, turns  # the returning turns hit something
