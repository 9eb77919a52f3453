"""L3 on LMDB when its disk fills up, through the real server: the server keeps serving, and a
write the disk has no room for is logged with its cause (ENOSPC) and where.

The disk is real and small: the server runs in a mount namespace of its own (``unshare
--mount``) with a 64 MiB tmpfs mounted on its L3 directory; the namespace and its mount end with
the server's processes. Once the server is up, the test fills that file system from outside
(``/proc/<pid>/root``: the file tree as the server sees it), the way other files would fill a
disk, then sends traffic whose pages go on to L3. Skipped where a mount namespace with a tmpfs
cannot be made (not root, no ``unshare``).

- ``writemap``: the map's blocks were allocated at open, so the writes go on (before, the first
  write into a hole of the sparse map killed the engine: SIGBUS). A map that cannot grow, or
  that does not fit at open: tests/cache/test_storage_lmdb_disk.py.
- the default mode: the writes fail, each burst logged once with "no space left on device
  (ENOSPC)" and the L3 directory.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from harness.server_utils import ROOT, ServerProcess

pytestmark = pytest.mark.slow

DISK_MB = 64
CAPACITY_GB = 0.03  # 30.7 MiB: fits the empty disk (the pre-flight's check), and is allocated up front with writemap
NO_SPACE = "no space left on device (ENOSPC)"
PROMPTS = 24
PAGES = PROMPTS * 9  # the second time a prompt of 160 tokens comes, 159 of them hit: 9 full pages go on to L3


def _mount_tmpfs(size_mb: int, where: Path) -> list[str]:
    """A command prefix: a new mount namespace with a tmpfs on ``where``, then exec the rest."""
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            f'mount -t tmpfs -o size={size_mb}m hicache-l3 "$0" && exec "$@"', str(where)]


def _cannot_mount(tmp_path: Path) -> str | None:
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        r = subprocess.run([*_mount_tmpfs(1, probe), "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run unshare: {e}"
    return None if r.returncode == 0 else f"cannot mount a tmpfs in a new mount namespace: {r.stderr.strip()}"


class ServerOnSmallDisk(ServerProcess):
    """A server whose ``disk`` is a tmpfs of ``DISK_MB`` in its own mount namespace."""

    def __init__(self, args: list[str], disk: Path) -> None:
        super().__init__(args)
        self.disk = disk
        self.prefix = _mount_tmpfs(DISK_MB, disk)  # unshare and sh exec: proc.pid is the server's

    def seen_disk(self) -> Path:
        """The tmpfs as the server sees it."""
        return Path(f"/proc/{self.proc.pid}/root{self.disk}")

    def fill_disk(self) -> int:
        """Fill the server's disk with another file, to the last block; its size."""
        n = 0
        with open(self.seen_disk() / "filler", "wb", buffering=0) as f:
            for chunk in (1 << 20, 4096):
                try:
                    while True:
                        n += f.write(b"\xa5" * chunk)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
        st = os.statvfs(self.seen_disk())
        assert st.f_bfree == 0, st
        return n


def metrics(server: ServerProcess) -> dict[str, float]:
    """The L3 events by name, and the write-back's gauges."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = {m[1]: float(m[2]) for m in re.finditer(
        r'^hicache_storage_events_total\{[^}]*event="([a-z_]+)"[^}]*\} ([0-9.e+]+)$', text, re.M)}
    for name in ("write_waiting_pages", "write_in_flight_pages"):
        m = re.search(rf"^hicache_storage_{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def written(server: ServerProcess) -> tuple[float, float]:
    """(pages stored, pages whose write failed) once the write-back has had every page (or 120 s)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            m = metrics(server)
        except httpx.HTTPError:  # a SIGBUS in the engine takes the server down
            code = server.proc.wait(30)
            raise AssertionError(f"the server died (exit {code}):\n{server.log()[-3000:]}") from None
        done = m.get("stored", 0) + m.get("store_failed", 0)
        idle = m["write_waiting_pages"] == 0 and m["write_in_flight_pages"] == 0
        if (done >= PAGES and idle) or time.monotonic() > deadline:
            return m.get("stored", 0), m.get("store_failed", 0)
        time.sleep(0.2)


def config(tmp_path: Path, disk: Path, **extra) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "l3.yaml").read_text())
    cfg["cache"]["hicache_storage_backend_extra_config"] = {"path": str(disk / "l3"), "capacity_gb": CAPACITY_GB,
                                                            **extra}
    cfg["cache"]["hicache_storage_prefetch_threshold"] = 16
    out = tmp_path / "l3.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def generate(server: ServerProcess, ids: list[int]) -> int:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    try:
        return httpx.post(server.url + "/generate", json=body, timeout=120).status_code
    except httpx.HTTPError:
        return 0


@pytest.mark.parametrize("extra", [{"writemap": True}, {}], ids=["writemap", "default"])
def test_a_full_disk_costs_writes_never_the_server(tmp_path, tiny_chat_model, extra):
    reason = _cannot_mount(tmp_path)
    if reason is not None:
        pytest.skip(reason)
    disk = tmp_path / "disk"
    disk.mkdir()
    args = ["--config", str(config(tmp_path, disk, **extra)), "--model-path", str(tiny_chat_model),
            "--served-model-name", "tiny"]
    s = ServerOnSmallDisk(args, disk)
    s.start()
    try:
        s.fill_disk()  # other files take every block left: L3's writes from now on meet a full disk
        prompts = [[(p * 131 + i * 17) % 40000 + 100 for i in range(160)] for p in range(PROMPTS)]
        codes = [generate(s, p) for p in prompts + prompts]  # the second time hits: pages go to L2, then L3
        stored, failed = written(s)
        assert codes == [200] * len(codes), (codes, s.log()[-3000:])
        assert generate(s, prompts[0]) == 200 and s.proc.poll() is None, s.log()[-3000:]  # still serving
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        where = f"on the file system of {disk / 'l3'}"
        if extra.get("writemap"):
            assert stored >= PAGES and failed == 0, (stored, failed)  # into the blocks allocated at open
        else:
            assert failed > 0, (stored, failed)
            assert re.search(rf"L3: \d+ of \d+ pages could not be written \(LMDBStore: {re.escape(NO_SPACE)} "
                             rf"{re.escape(where)}", s.log()), s.log()[-3000:]
    finally:
        code = s.stop()
    assert code == 0, s.log()[-3000:]
    assert "Traceback" not in s.log(), s.log()
