"""Network namespaces for tests that run servers which must not touch the machine's network
(Mooncake's transfer engine listens on a LAN address and refuses loopback-only hosts).

A :class:`NetNS` has loopback plus a veth pair carrying :attr:`NetNS.address`; every
process started with :meth:`NetNS.popen` lives inside it, so all traffic stays there.
Needs root and ``ip`` (iproute2). The pytest process itself stays outside: run servers and
clients as subprocesses. Always ``delete()`` (a fixture's finalizer), also when tests fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

ADDRESS = "10.213.0.1"


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating a network namespace needs root"
    return None


class NetNS:
    """A fresh, uniquely named network namespace (``hct-<pid>-<random>``)."""

    def __init__(self, prefix: str = "hct") -> None:
        self.name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.address = ADDRESS
        self._created = False

    def create(self) -> NetNS:
        """Create it (raises ``RuntimeError`` with ip's message when that fails)."""
        self._ip("netns", "add", self.name)
        self._created = True
        try:
            for cmd in (
                ["link", "set", "lo", "up"],
                ["link", "add", "hc0", "type", "veth", "peer", "name", "hc1"],
                ["addr", "add", f"{self.address}/24", "dev", "hc0"],
                ["link", "set", "hc0", "up"],
                ["link", "set", "hc1", "up"],
            ):
                self._ip("netns", "exec", self.name, "ip", *cmd)
        except BaseException:
            self.delete()
            raise
        return self

    def delete(self) -> None:
        """Remove the namespace (processes still inside keep running until they exit)."""
        if self._created:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
            self._created = False

    def popen(self, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside the namespace (``ip netns exec`` execs it: same pid)."""
        return subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kw)

    def port_open(self, port: int, host: str = "127.0.0.1") -> bool:
        probe = f"exec 3<>/dev/tcp/{host}/{port}"
        r = subprocess.run(["ip", "netns", "exec", self.name, "bash", "-c", probe], capture_output=True, check=False)
        return r.returncode == 0

    def wait_port(self, port: int, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.port_open(port):
                return True
            time.sleep(0.05)
        return False

    @staticmethod
    def _ip(*args: str) -> None:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    def __enter__(self) -> NetNS:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.delete()


class MooncakeMaster:
    """``mooncake_master`` with its HTTP metadata server, inside a :class:`NetNS`."""

    def __init__(self, ns: NetNS, log: Path, rpc_port: int = 50051, http_port: int = 50080,
                 metrics_port: int = 50090) -> None:
        self.ns, self.log = ns, log
        self.rpc_port, self.http_port, self.metrics_port = rpc_port, http_port, metrics_port
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def binary() -> str | None:
        local = Path(sys.executable).parent / "mooncake_master"
        return str(local) if local.exists() else shutil.which("mooncake_master")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self, timeout: float = 15.0) -> None:
        argv = [
            self.binary(),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_port={self.metrics_port}",
        ]
        with open(self.log, "ab") as f:
            self.proc = self.ns.popen(argv, stdout=f, stderr=subprocess.STDOUT)
        if not (self.ns.wait_port(self.rpc_port, timeout) and self.ns.wait_port(self.http_port, timeout)):
            self.stop()
            raise RuntimeError(f"mooncake_master did not come up; see {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


def run_mooncake_script(script: str | Path, *args: str, timeout: float = 400) -> dict:
    """Run the Python file ``script`` (its last stdout line a JSON object) in a network namespace of its
    own, with the namespace's address as its last argument; skips the test where namespaces or
    ``mooncake_master`` are unavailable. Whatever happens, no server or master outlives it."""
    import json

    import pytest

    from harness.server_utils import kill_tree

    reason = unavailable_reason()
    if reason or not (Path(sys.executable).parent / "mooncake_master").exists():
        pytest.skip(reason or "mooncake_master is not installed")
    root = Path(__file__).resolve().parent.parent
    ns = NetNS()
    ns.create()
    proc = None
    try:
        proc = ns.popen([sys.executable, str(script), *args, ns.address], stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True, cwd=root)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc is not None:
            kill_tree(proc)
        ns.delete()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, out[-4000:]
    return json.loads(lines[-1])

