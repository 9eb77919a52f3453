"""The LMDB store and its disk: a full disk costs writes (logged with ENOSPC and where), never
the process, with or without ``writemap``; a store whose header is damaged is one line.

The full disks are real: a child process (this file run as a script: ``python
tests/cache/test_storage_lmdb_disk.py child DIR OPTIONS``) opens a real LMDBStore under a
StorageTier on a small tmpfs mounted on DIR in a mount namespace of its own (``unshare
--mount``; the mount ends with the child), writes more pages than the disk holds and prints
what happened. A SIGBUS kills the child. Skipped where such a mount cannot be made.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.lmdb_pages import PS, SMALL, fill, keys_for, open_store
from hicache.tiers.base import StorageOpenError
from hicache.tiers.host import make_host_pool
from hicache.tiers.lmdb.disk import filesystem
from hicache.tiers.storage import StorageTier

REPO = Path(__file__).resolve().parents[2]
NO_SPACE = "no space left on device (ENOSPC)"
ROUNDS, BATCH = 40, 64  # 2,560 values of 8 KiB (4 KiB pages: two LMDB pages each): 20 MiB, more than any disk here


def _mount_tmpfs(size_mb: int, where: Path) -> list[str]:
    """A command prefix: a new mount namespace with a tmpfs on ``where``, then exec the rest."""
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            f'mount -t tmpfs -o size={size_mb}m hicache-l3 "$0" && exec "$@"', str(where)]


def run_on_small_disk(tmp_path: Path, size_mb: int, options: dict) -> tuple[int, dict, str]:
    """(exit status, the child's report, its log) of the child on a tmpfs of ``size_mb``."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        probe = subprocess.run([*_mount_tmpfs(1, disk), "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot run unshare: {e}")
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a new mount namespace: {probe.stderr.strip()}")
    r = subprocess.run([*_mount_tmpfs(size_mb, disk), sys.executable, __file__, "child", str(disk),
                        json.dumps(options)], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = r.stdout.strip().splitlines()
    return r.returncode, json.loads(lines[-1]) if lines else {}, r.stderr


def _child(disk: str, options: dict) -> None:
    """Open the store on ``disk`` (``fill_after_open``: then fill the disk with another file),
    write ROUNDS x BATCH pages through a StorageTier, print a JSON report."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    fill_after_open = options.pop("fill_after_open", False)
    store = open_store(Path(disk) / "db", **options)
    if fill_after_open:  # other files take every block left
        with open(Path(disk) / "filler", "wb", buffering=0) as f:
            for chunk in (1 << 20, 4096):
                try:
                    while True:
                        f.write(b"\xa5" * chunk)
                except OSError:
                    pass
    tier = StorageTier(store, SMALL, PS, max_batch_pages=8)
    pool = make_host_pool("page_first", SMALL, BATCH, PS)
    fill(pool, 1)
    stored = 0
    for r in range(ROUNDS):
        stored += tier.batch_set(keys_for(BATCH, salt=r + 1), pool, list(range(BATCH)))
    print(json.dumps({"writemap": store.handles.writemap, "filesystem": filesystem(disk), "stored": stored,
                      "failed": ROUNDS * BATCH - stored, "free": os.statvfs(disk).f_bfree}))
    tier.close()


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "child":
    _child(sys.argv[2], json.loads(sys.argv[3]))


def test_writemap_with_a_map_larger_than_the_disk_is_turned_off_not_a_sigbus(tmp_path):
    # value files off: a store whose values all go to its map (value files are more compact: the disk has room)
    code, out, log = run_on_small_disk(tmp_path, 16, {"capacity_gb": 0.05, "writemap": True, "value_files": False})
    assert code == 0, (code, log)  # a SIGBUS would be -7
    assert out["filesystem"] == "tmpfs" and out["writemap"] is False, out
    assert re.search(rf"L3: writemap is off: the map's 51\.2 MiB could not be allocated on disk up front "
                     rf"\({re.escape(NO_SPACE)} on the file system of {tmp_path}/disk/db", log), log
    # the store works without it, and the writes the disk has no room for are logged with their cause
    assert out["stored"] > 0 and out["failed"] > 0, out
    assert re.search(rf"L3: \d+ of \d+ pages could not be written \(LMDBStore: {re.escape(NO_SPACE)} on the file "
                     rf"system of {tmp_path}/disk/db \(0\.0 MiB free\)\)", log), log


def test_writemap_store_keeps_writing_when_the_disk_fills_after_it_opened(tmp_path):
    """The map's blocks were allocated at open: writes (and evictions) go on in them."""
    code, out, log = run_on_small_disk(tmp_path, 32, {"capacity_gb": 0.01, "writemap": True,
                                                      "fill_after_open": True})
    assert code == 0, (code, log)
    assert out["writemap"] is True and out["free"] == 0, out
    assert out["failed"] == 0 and out["stored"] == ROUNDS * BATCH, (out, log)


def test_writemap_map_that_cannot_grow_is_logged_and_the_store_evicts(tmp_path):
    code, out, log = run_on_small_disk(tmp_path, 32, {"capacity_gb": 0.01, "writemap": True, "initial_map_mb": 1,
                                                      "fill_after_open": True})
    assert code == 0, (code, log)
    assert out["writemap"] is True and out["failed"] == 0, (out, log)
    assert re.search(rf"L3: the LMDB map cannot grow from 1\.0 MiB to 2\.0 MiB: {re.escape(NO_SPACE)} on the file "
                     rf"system of {tmp_path}/disk/db", log), log
    assert len(re.findall("cannot grow", log)) == 1, log  # rate-limited


@pytest.mark.parametrize("value_files", [True, False], ids=["value-files", "inline"])
def test_default_mode_full_disk_write_failures_name_enospc(tmp_path, value_files):
    code, out, log = run_on_small_disk(tmp_path, 32, {"capacity_gb": 0.01, "fill_after_open": True,
                                                      "value_files": value_files})
    assert code == 0, (code, log)
    assert out["writemap"] is False and out["stored"] == 0 and out["failed"] == ROUNDS * BATCH, out
    lines = re.findall(r"L3: \d+ of \d+ pages could not be written.*", log)
    assert len(lines) == 1, log  # one line per interval, as before
    assert f"(LMDBStore: {NO_SPACE} on the file system of {tmp_path}/disk/db (0.0 MiB free))" in lines[0], lines


def test_a_damaged_header_is_one_line_naming_the_file_and_what_to_do(tmp_path):
    path = tmp_path / "l3"
    store = open_store(path, capacity_gb=0.05)
    assert store.set("k", b"v" * 10_000)
    store.close()
    with open(path / "data.mdb", "r+b") as f:  # garbage over both meta pages
        f.write(os.urandom(8192))
    with pytest.raises(StorageOpenError) as e:
        open_store(path, capacity_gb=0.05)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"L3: {path}/data.mdb is not an LMDB data file: its header is damaged"), msg
    assert "MDB_INVALID" in msg and f"move or delete the directory {path}" in msg, msg
    assert '"path" in --hicache-storage-backend-extra-config' in msg, msg
    # what it says to do works: the directory moved away, a fresh store is made
    path.rename(tmp_path / "l3.damaged")
    fresh = open_store(path, capacity_gb=0.05)
    assert fresh.set("k", b"v") and fresh.get("k") == b"v"
    fresh.close()
