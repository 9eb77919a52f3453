"""KV transports for PD disaggregation (serving/disagg), real backends across two processes.

Sender and receiver are this file run as a script, each holding a 4 MiB torch CPU buffer::

    python tests/disagg/test_pd_transport.py child BACKEND '{"host": ..., "timeout_s": ...}'

answering one JSON command per stdin line with one JSON line on stdout. Mooncake's engine listens
on all interfaces, so its two processes run inside a network namespace of their own
(harness/netns.py); NIXL runs over UCX tcp on loopback (UCX_TLS=tcp,self,sm UCX_NET_DEVICES=lo).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.netns import NetNS, unavailable_reason
from serving.disagg.transport import TRANSPORTS, make_transport, raw_write_gbps
from serving.disagg.transport_base import TransferError, TransportConfig, coalesce

REPO = Path(__file__).resolve().parents[2]
NBYTES = 4 << 20
pytestmark = pytest.mark.timeout(60)  # a hung transfer fails the test
# (with "sm" UCX moves same-host bytes through shared memory; UCX_TLS=tcp,self forces real TCP)
NIXL_ENV = {"UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm"), "UCX_NET_DEVICES": "lo"}


# ---------------------------------------------------------------------- child side
def _child(backend: str, config: dict) -> None:
    import torch

    proto = os.fdopen(os.dup(1), "w")  # replies on a private copy of stdout: backends' logs go to stderr
    os.dup2(2, 1)

    def reply(**kw) -> None:
        proto.write(json.dumps(kw) + "\n")
        proto.flush()

    buf = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(os.getpid()))
    base = buf.data_ptr()
    t = make_transport(backend, TransportConfig(**config))
    t.register(base, NBYTES)
    reply(endpoint=t.endpoint(), ptr=base, nbytes=NBYTES)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        t0 = time.monotonic()
        if op == "dump":
            Path(cmd["path"]).write_bytes(buf.numpy().tobytes())
            reply(ok=True)
        elif op == "write":
            reply(**_write(t, base, cmd), s=time.monotonic() - t0)
        elif op == "selfbench":  # a second transport in this process, and the benchmark helper
            other = torch.zeros(NBYTES, dtype=torch.uint8)
            with make_transport(backend, TransportConfig(**config)) as t2:
                t2.register(other.data_ptr(), NBYTES)
                gbps = raw_write_gbps(t, t2, NBYTES, cmd["chunk"])
            reply(gbps=gbps, equal=bool(torch.equal(buf.view(-1, cmd["chunk"]).flip(0).view(-1), other)))
        elif op == "quit":
            t.close()
            reply(bye=True)
            os._exit(0)  # skip slow native destructors


def _write(t, base: int, cmd: dict) -> dict:
    """One write command: src given as offsets into our buffer; "threads" > 1 splits the batch."""
    src, dst, n = [base + o for o in cmd["src"]], cmd["dst"], cmd["len"]
    k = cmd.get("threads", 1)
    errors: list[BaseException] = []

    def part(i: int) -> None:
        try:
            t.write(cmd["peer"], src[i::k], dst[i::k], n[i::k])
        except BaseException as e:  # noqa: B036 - reported to the test
            errors.append(e)

    threads = [threading.Thread(target=part, args=(i,)) for i in range(k)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    err = errors[0] if errors else None
    return {"ok": err is None, "error": type(err).__name__ if err else None, "msg": str(err or "")}


# ---------------------------------------------------------------------- test side
class Child:
    """A sender or receiver process, driven by JSON lines, every answer under a timeout."""

    def __init__(self, argv_prefix: list[str], backend: str, config: dict, log: Path, env: dict) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [*argv_prefix, sys.executable, __file__, "child", backend, json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "ab"),  # noqa: SIM115 - the child owns it
            text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env},
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def ready(self) -> Child:
        """Wait for the hello line: endpoint and buffer address."""
        hello = self._read(30)
        self.ptr, self.endpoint = hello["ptr"], hello["endpoint"]
        return self

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"child did not answer within {timeout}s; see {self.log}") from None
        if line is None:
            raise AssertionError(f"child exited (rc={self.proc.wait()}): {self.log.read_text()[-3000:]}")
        return json.loads(line)

    def __call__(self, op: str, timeout: float = 15, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def dump(self, path: Path) -> bytes:
        assert self("dump", path=str(path))["ok"]
        return path.read_bytes()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self("quit", timeout=10)
            except (AssertionError, OSError):
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _mooncake_skip() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine-non-cuda is not installed"
    return unavailable_reason()


def _nixl_skip() -> str | None:
    if not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12", "nixl_cu13")):
        return "nixl cannot be imported (pip install --no-deps nixl-cu12==1.5.1; see Makefile setup)"
    return None


@pytest.fixture(params=["mooncake", "nixl"])
def pair(request, tmp_path):
    """(sender, receiver) children of one backend."""
    backend = request.param
    reason = _mooncake_skip() if backend == "mooncake" else _nixl_skip()
    if reason:
        pytest.skip(f"{backend}: {reason}")
    ns, children = None, []
    if backend == "mooncake":
        ns = NetNS("hcpd")
        try:
            ns.create()
        except RuntimeError as e:
            pytest.skip(f"cannot create a network namespace: {e}")
        prefix, env, config = ["ip", "netns", "exec", ns.name], {}, {"host": ns.address}
    else:
        prefix, env, config = [], NIXL_ENV, {"timeout_s": 5.0}
    try:
        for role in ("sender", "receiver"):  # both start at once, then both must be ready
            children.append(Child(prefix, backend, config, tmp_path / f"{backend}-{role}.log", env))
        yield backend, children[0].ready(), children[1].ready()
    finally:
        for c in children:
            c.stop()
        if ns is not None:
            ns.delete()


def scattered(seed: int, n: int = 64, slot: int = 16 << 10) -> tuple[list[int], list[int], list[int]]:
    """``n`` chunks (src offset, dst offset, length) over distinct random 16 KiB slots; a run of 8 chunks is
    contiguous on both sides (it coalesces) and one chunk is 1 byte long."""
    rng = random.Random(seed)
    slots = NBYTES // slot
    s_slots, d_slots = rng.sample(range(slots - 8), n - 8), rng.sample(range(slots - 8), n - 8)
    src = [i * slot for i in s_slots] + [(slots - 8 + i) * slot for i in range(8)]
    dst = [i * slot for i in d_slots] + [(slots - 8 + i) * slot for i in range(8)]
    lengths = [rng.randint(1, slot) for _ in range(n - 8)] + [slot] * 8
    lengths[0] = 1
    return src, dst, lengths


def expect(recv: bytes, send: bytes, src: list[int], dst: list[int], lengths: list[int]) -> bytes:
    out = bytearray(recv)
    for s, d, n in zip(src, dst, lengths, strict=True):
        out[d : d + n] = send[s : s + n]
    return bytes(out)


def test_write_scattered_chunks_exact(pair, tmp_path):
    backend, snd, rcv = pair
    send, before = snd.dump(tmp_path / "s0"), rcv.dump(tmp_path / "r0")
    src, dst, lengths = scattered(1)
    r = snd("write", peer=rcv.endpoint, src=src, dst=[rcv.ptr + d for d in dst], len=lengths)
    assert r["ok"], r
    got = rcv.dump(tmp_path / "r1")
    assert got == expect(before, send, src, dst, lengths)
    # again, split over 4 concurrent sender threads (write() is thread-safe), other chunks
    src2, dst2, len2 = scattered(2)
    r = snd("write", peer=rcv.endpoint, src=src2, dst=[rcv.ptr + d for d in dst2], len=len2, threads=4)
    assert r["ok"], r
    assert rcv.dump(tmp_path / "r2") == expect(got, send, src2, dst2, len2)
    # 4096 chunks of 1 KiB in one write, landing in reverse order (nothing coalesces): more than
    # Mooncake's per-peer queue holds, so the transport must split the batch
    k, c = 4096, 1024
    src3, dst3 = [i * c for i in range(k)], [(k - 1 - i) * c for i in range(k)]
    r = snd("write", peer=rcv.endpoint, src=src3, dst=[rcv.ptr + d for d in dst3], len=[c] * k)
    assert r["ok"], r
    assert rcv.dump(tmp_path / "r3") == expect(got, send, src3, dst3, [c] * k)
    assert snd.dump(tmp_path / "s1") == send  # the sender's buffer is untouched
    r = snd("selfbench", chunk=64 << 10)  # two transports in one process; the benchmark helper
    assert r["gbps"] > 0 and r["equal"], r


def test_bad_destination_and_unknown_peer_raise(pair, tmp_path):
    backend, snd, rcv = pair
    before = rcv.dump(tmp_path / "r0")
    end = rcv.ptr + NBYTES
    for dst, n in ((end, 4096), (end - 100, 4096), (rcv.ptr - 4096, 4096)):  # past the end / straddling / before
        r = snd("write", peer=rcv.endpoint, src=[0], dst=[dst], len=[n])
        assert not r["ok"] and r["error"] == "TransferError", r
    peer = rcv.endpoint["session"] if backend == "mooncake" else rcv.endpoint["agent"]
    assert peer in r["msg"]  # the error names the peer
    if backend == "mooncake":
        unknown = {"session": f"{rcv.endpoint['session'].split(':')[0]}:1"}
    else:
        unknown = {"agent": "nobody", "metadata": base64.b64encode(b"not metadata").decode()}
    for bad in (unknown, {}):
        r = snd("write", peer=bad, src=[0], dst=[rcv.ptr], len=[4096])
        assert not r["ok"] and r["error"] == "TransferError", r
    assert rcv.dump(tmp_path / "r1") == before  # nothing landed
    # the sender is not poisoned: a good write still works
    r = snd("write", peer=rcv.endpoint, src=[0], dst=[rcv.ptr], len=[4096])
    assert r["ok"], r


def test_peer_gone_raises_not_hangs(pair):
    backend, snd, rcv = pair
    assert snd("write", peer=rcv.endpoint, src=[0], dst=[rcv.ptr], len=[4096])["ok"]  # connected
    rcv.proc.kill()
    rcv.proc.wait(5)
    r = snd("write", peer=rcv.endpoint, src=[0], dst=[rcv.ptr], len=[1 << 20], timeout=15)
    assert not r["ok"] and r["error"] == "TransferError", r


def test_coalesce():
    assert coalesce([], [], []) == ([], [], [])
    assert coalesce([0, 10, 20], [100, 110, 120], [10, 10, 5]) == ([0], [100], [25])
    assert coalesce([0, 10, 30], [100, 110, 120], [10, 10, 5]) == ([0, 30], [100, 120], [20, 5])  # src gap
    assert coalesce([0, 10], [100, 200], [10, 10]) == ([0, 10], [100, 200], [10, 10])  # dst gap
    assert coalesce([10, 0], [110, 100], [10, 10]) == ([10, 0], [110, 100], [10, 10])  # order is kept
    assert coalesce([0, 10, 10, 10], [0, 7, 99, 10], [10, 0, 0, 4]) == ([0], [0], [14])  # empty chunks dropped
    big = 1 << 46
    assert coalesce([big, big + 8], [8, 16], [8, 8]) == ([big], [8], [16])
    with pytest.raises(ValueError):
        coalesce([0], [0], [-1])


def test_registry():
    assert set(TRANSPORTS) == {"cuda_ipc", "mooncake", "nixl"}
    with pytest.raises(ValueError, match="cuda_ipc, mooncake, nixl"):
        make_transport("rdma", TransportConfig())
    with pytest.raises(TransferError):
        raise TransferError("is a RuntimeError") from None


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    sys.path.insert(0, str(REPO))
    _child(sys.argv[2], json.loads(sys.argv[3]))
