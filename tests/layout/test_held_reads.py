"""harness/slow_storage.py's held reads never keep a process alive: a test that fails while a read is
held (a reader thread waiting at the store's gate) still ends its pytest process, because the
``slow_lmdb`` fixture releases every store it made at teardown (CI would otherwise wait for a
process that never exits, instead of naming the failure)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HELD = '''
from concurrent.futures import ThreadPoolExecutor

from harness.slow_storage import slow_lmdb  # noqa: F401
from hicache.tiers import storage
from hicache.tiers.base import StagingBuffer


def test_fails_while_a_read_is_held(tmp_path, slow_lmdb):  # noqa: F811
    store = storage.STORAGE_BACKENDS[slow_lmdb]({"path": str(tmp_path / "l3"), "capacity_gb": 0.01})
    assert store.set("k", b"v" * 64)
    store.hold()
    readers = ThreadPoolExecutor(1)  # joined when the interpreter exits, as the tier's readers are
    readers.submit(store.batch_get_into, ["k"], StagingBuffer(4096), [(0, 4096)])
    assert False, "fails with its read held"
'''


def test_a_failed_test_with_a_held_read_ends_its_process(tmp_path: Path) -> None:
    (tmp_path / "test_held.py").write_text(HELD)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:langsmith_plugin",
           "-p", "no:xdist", str(tmp_path / "test_held.py")]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert "1 failed" in out.stdout and "fails with its read held" in out.stdout, out.stdout + out.stderr
