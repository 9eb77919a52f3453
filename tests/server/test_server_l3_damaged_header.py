"""A server whose L3 store (LMDB) has a damaged header does not start: one line naming the file,
what is wrong and what to do, exit status 2, no traceback (docs/storage.md: a full disk, a damaged
store)."""

from __future__ import annotations

import os

import pytest
import yaml

from harness.lmdb_pages import open_store
from harness.server_utils import ROOT, ServerProcess

pytestmark = pytest.mark.slow


def test_a_damaged_l3_header_stops_the_start_with_one_line(tmp_path, tiny_chat_model):
    l3 = tmp_path / "l3"
    store = open_store(l3, capacity_gb=0.05)  # a real store with a value in it
    assert store.set("k", b"v" * 10_000)
    store.close()
    with open(l3 / "data.mdb", "r+b") as f:  # garbage over its first pages (both meta pages)
        f.write(os.urandom(16384))
    cfg = yaml.safe_load((ROOT / "configs" / "l3.yaml").read_text())
    cfg["cache"]["hicache_storage_backend_extra_config"] = {"path": str(l3), "capacity_gb": 0.05}
    (tmp_path / "l3.yaml").write_text(yaml.safe_dump(cfg))
    s = ServerProcess(["--config", str(tmp_path / "l3.yaml"), "--model-path", str(tiny_chat_model),
                       "--served-model-name", "tiny"])
    with pytest.raises(RuntimeError, match="server exited with 2"):
        s.start()
    log = s.log()
    assert "Traceback" not in log, log
    lines = [line for line in log.splitlines() if "is not an LMDB data file" in line]
    assert len(lines) == 1, log
    assert f"L3: {l3}/data.mdb is not an LMDB data file: its header is damaged" in lines[0], lines
    assert f"move or delete the directory {l3}" in lines[0], lines
    assert '"path" in --hicache-storage-backend-extra-config' in lines[0], lines
    assert (l3 / "data.mdb").exists()  # nothing is deleted
