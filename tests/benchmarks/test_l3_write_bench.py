"""bench/l3_write.py runs end to end at a tiny size and writes the JSON the docs and the H200 run read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_l3_write_bench_reports_raw_and_every_shard_count(tmp_path):
    out = tmp_path / "w.json"
    run = subprocess.run([sys.executable, "bench/l3_write.py", "--shape", "small", "--pages", "24", "--shards", "1,2",
                          "--rounds", "1", "--sync", "off", "--writers", "2", "--workdir", str(tmp_path / "work"),
                          "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["raw"]["best"] > 0 and set(data["raw"]) == {"1_files", "2_files", "best"}
    for shards in (1, 2):
        row = data[f"{shards}_shards"]
        assert row["store"] > 0 and row["tier"] > 0
        assert row["tier_over_raw"] == row["tier"] / data["raw"]["best"]
    assert data["cpu"] and isinstance(data["avx512"], bool) and data["pages"] == 24
    assert data["value_files"] is True  # the store's default (LMDBConfig.value_files)
    assert not any((tmp_path / "work").iterdir())  # every store and raw file removed
