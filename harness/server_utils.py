"""Run a real ``hicache serve`` subprocess on a free port for end-to-end tests."""

from __future__ import annotations

import collections
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
READY = "The server is fired up and ready to roll!"  # followed by the server's URL (serving/server/serve.py)
ROUTER_READY = "The router is ready to route!"  # router/cli.py


# Ports for the servers tests start come from below the kernel's ephemeral range (32768-60999
# by default), so an outgoing connection can never take one between its choice and the server's
# bind (seconds later, after the model loads); each xdist worker has its own block, and a
# process starts at a random place in it, so two processes rarely try the same port.
PORT_BLOCK = 2000
PORT_BASE = 20000


def _worker_index() -> int:
    w = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(w[2:]) if w[2:].isdigit() else 0


_port_lock = threading.Lock()
_next_port = [random.randrange(PORT_BLOCK)]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, outside the ephemeral range."""
    base = PORT_BASE + (_worker_index() % 6) * PORT_BLOCK
    with _port_lock:
        for _ in range(PORT_BLOCK):
            port = base + _next_port[0] % PORT_BLOCK
            _next_port[0] += 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no free port in {base}-{base + PORT_BLOCK - 1}")


class ServerProcess:
    """``api_key_env``: pass the key in the environment (HICACHE_API_KEY), not as a flag."""

    command, ready_line = "serve", READY

    def __init__(self, args: list[str], api_key: str | None = None, api_key_env: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port), "--enable-debug-endpoints"]
        self.env: dict[str, str] = {}
        if api_key and api_key_env:
            self.env["HICACHE_API_KEY"] = api_key
        elif api_key:
            self.args += ["--api-key", api_key]
        self.prefix: list[str] = []  # a command the server runs under (e.g. unshare ... sh -c 'exec "$@"')
        self.lines: collections.deque[str] = collections.deque(maxlen=400)
        self.ready = threading.Event()
        self.proc: subprocess.Popen[str] | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return "".join(self.lines)

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith(self.ready_line):
                self.ready.set()

    def start(self, timeout: float = 120.0) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # one of several processes per core
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        if "HICACHE_API_KEY" not in self.env:
            env.pop("HICACHE_API_KEY", None)  # only the key this test means
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "serving.launch.cli", self.command, *self.args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")
        assert httpx.get(self.url + "/health", timeout=10).status_code == 200

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM; returns the exit status (0 for a clean shutdown of both processes)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"server did not stop within {timeout} s:\n{self.log()}") from None
        self.reader.join(10)  # its last lines (the shutdown's) are in self.lines
        return self.proc.returncode

    def check_integrity(self, settle_s: float = 10.0) -> dict:
        """The engine's integrity check, once no request is running or waiting (aborts are async)."""
        deadline = time.monotonic() + settle_s
        while True:
            r = httpx.post(self.url + "/debug/check_integrity", headers=self.headers, timeout=30)
            assert r.status_code == 200, r.text
            body = r.json()
            if (body["running"] == 0 and body["waiting"] == 0) or time.monotonic() > deadline:
                return body
            time.sleep(0.1)


class RouterProcess(ServerProcess):
    """``hicache router ARGS`` on a free port (``api_key``: its --api-key)."""

    command, ready_line = "router", ROUTER_READY

    def __init__(self, args: list[str], api_key: str | None = None) -> None:
        super().__init__([], api_key)
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port)] + (
            ["--api-key", api_key] if api_key else [])


@contextmanager
def running_server(args: list[str], api_key: str | None = None, api_key_env: bool = False) -> Iterator[ServerProcess]:
    """Start a server, yield it, stop it with SIGTERM and assert it exited cleanly."""
    server = ServerProcess(args, api_key, api_key_env)
    server.start()
    try:
        yield server
    finally:
        code = server.stop()
    assert code == 0, f"server exited with {code}:\n{server.log()}"
    assert "Traceback" not in server.log(), server.log()


def start_all(*servers: ServerProcess, timeout: float = 120.0) -> None:
    """Start servers in parallel threads (model loads overlap); every one must come up."""
    threads = [threading.Thread(target=s.start, kwargs={"timeout": timeout}) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [s for s in servers if not s.ready.is_set()]
    if failed:  # the ones that did start go too: the caller's cleanup never saw them
        for s in servers:
            if s.proc is not None:
                kill_tree(s.proc)
        raise RuntimeError("a server did not start:\n" + failed[0].log()[-3000:])


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process and all its descendants (a driver and the servers it started)."""
    import psutil

    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    for kid in kids:
        try:
            kid.kill()
        except psutil.NoSuchProcess:
            pass
    proc.kill()
    proc.wait()


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS since the last reset) of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out
