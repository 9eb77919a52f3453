"""The Mooncake Store backend against a real ``mooncake_master``, inside a network namespace.

The pytest process cannot enter the namespace, so the master and the clients run there as
subprocesses (see harness/netns.py). A client is this file run as a script::

    ip netns exec NS python tests/cache/test_storage_mooncake.py client '<MooncakeConfig as JSON>'

It builds a StorageTier over a MooncakeStore and answers one JSON command per stdin line
with one JSON line on stdout (set / get / exists / corrupt / stats / wait_connected / quit);
pages hold deterministic content (page_data), so any client can verify what another wrote.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from harness.netns import MooncakeMaster, NetNS, unavailable_reason

PS = 16
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- client side (in the netns)
def _client(config: dict) -> None:
    from hicache.keys import namespace_for, page_keys
    from hicache.tiers.device import KVLayout
    from hicache.tiers.host import make_host_pool
    from hicache.tiers.storage import StorageTier, make_storage

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)  # 8 KiB pages
    keys = page_keys([t % 30000 for t in range(1024 * PS)], PS, namespace_for("test/mc", layout, page_size=PS))

    def page_data(i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(7 + i)
        return torch.randn(2 * layout.num_layers, 1, PS * 2 * 32, generator=g).to(layout.dtype)

    def reply(**kw) -> None:
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    t0 = time.monotonic()
    backend = make_storage("mooncake", config)
    tier = StorageTier(backend, layout, PS, max_batch_pages=8)  # several chunks per call
    reply(ready=True, connected=backend.connected, ms=1000 * (time.monotonic() - t0))
    for line in sys.stdin:
        cmd = json.loads(line)
        op, first, n = cmd["op"], cmd.get("first", 0), cmd.get("n", 0)
        ks = keys[first : first + n]
        t0 = time.monotonic()
        if op == "set":
            pool = make_host_pool(cmd.get("layout", "page_first"), layout, n, PS)
            pool.write_pages(torch.arange(n), torch.cat([page_data(first + i) for i in range(n)], dim=1))
            res = {"stored": tier.batch_set(ks, pool, list(range(n)))}
        elif op == "get":
            pool = make_host_pool(cmd.get("layout", "layer_first"), layout, n, PS)
            k = tier.batch_get(ks, pool, list(range(n)))
            want = torch.cat([page_data(first + i) for i in range(k)], dim=1) if k else None
            equal = k == 0 or torch.equal(pool.read_pages(torch.arange(k)), want)
            res = {"loaded": k, "equal": equal}
        elif op == "exists":
            res = {"n": tier.batch_exists(ks)}
        elif op == "corrupt":  # flip one payload byte of a stored value (put keeps old values)
            raw = bytearray(backend.get(ks[0]))
            raw[-100] ^= 0x04
            res = {"ok": backend.delete(ks[0]) and backend.set(ks[0], bytes(raw))}
        elif op == "get_during_held_write":  # a write-back's put held inside the real client
            res = _get_during_held_write(backend, tier, layout, keys, page_data, first, n, cmd["wn"])
        elif op == "stats":
            res = tier.stats()
        elif op == "wait_connected":
            deadline = time.monotonic() + cmd["within"]
            while not backend.connected and time.monotonic() < deadline:
                time.sleep(0.05)
            res = {"connected": backend.connected}
        elif op == "quit":
            backend.close()
            reply(bye=True)
            os._exit(0)  # skip the client's slow destructors
        else:
            res = {"error": f"unknown op {op}"}
        reply(ms=1000 * (time.monotonic() - t0), **res)


def _get_during_held_write(backend, tier, layout, keys, page_data, first: int, n: int, wn: int) -> dict:
    """Hold the client's ``batch_put_from`` (the real call runs once released), start a
    ``batch_set`` of ``wn`` pages after ``first + n`` on a thread, and read pages ``first ..
    first + n`` while that write is held; then release it."""
    from hicache.tiers.host import make_host_pool

    real, started, gate = backend.conn.client.store, threading.Event(), threading.Event()

    class Held:
        def __getattr__(self, name):
            return getattr(real, name)

        def batch_put_from(self, *args):
            started.set()
            gate.wait(60)
            return real.batch_put_from(*args)

    backend.conn.client.store = Held()
    wpool = make_host_pool("page_first", layout, wn, PS)
    wpool.write_pages(torch.arange(wn), torch.cat([page_data(first + n + i) for i in range(wn)], dim=1))
    written: dict = {}
    writer = threading.Thread(target=lambda: written.update(
        stored=tier.batch_set(keys[first + n : first + n + wn], wpool, list(range(wn)))))
    writer.start()
    held = started.wait(30)
    got: dict = {}

    def read() -> None:
        pool = make_host_pool("page_first", layout, n, PS)
        k = tier.batch_get(keys[first : first + n], pool, list(range(n)))
        want = torch.cat([page_data(first + i) for i in range(k)], dim=1) if k else None
        got.update(loaded=k, equal=k == 0 or torch.equal(pool.read_pages(torch.arange(k)), want))

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(20)  # a read behind the held write would wait here until the write's release
    read_while_held = not reader.is_alive() and not gate.is_set()
    gate.set()
    reader.join()
    writer.join()
    backend.conn.client.store = real
    return {"held": held, "read_while_held": read_while_held, **got, **written}


# ---------------------------------------------------------------------- test side
def _skip_reason() -> str | None:
    reason = unavailable_reason()
    if reason:
        return reason
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"mooncake-transfer-engine-non-cuda is not installed ({e})"
    if MooncakeMaster.binary() is None:
        return "mooncake_master is not on PATH"
    return None


class Client:
    """A client process in the namespace, driven by JSON lines."""

    def __init__(self, ns: NetNS, master: MooncakeMaster, log: Path, **overrides) -> None:
        config = {
            "master_server_address": master.address,
            "metadata_server": master.metadata_url,
            "local_hostname": ns.address,
            "global_segment_mb": 64,
            "local_buffer_mb": 16,
            "timeout_s": 1.0,
            "setup_timeout_s": 5.0,
            "backoff_s": 0.2,
            "max_backoff_s": 1.0,
            **overrides,
        }
        self.log = log
        self.proc = ns.popen(
            [sys.executable, __file__, "client", json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log, "ab"),  # noqa: SIM115 - the child owns it
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.hello = self._read(60)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"client did not answer within {timeout}s; see {self.log}") from None
        if line is None:
            raise AssertionError(f"client exited (rc={self.proc.wait()}); see {self.log}")
        return json.loads(line)

    def __call__(self, op: str, timeout: float = 30, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def quit(self, wait: bool = True) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass
        if wait:
            self.wait()

    def wait(self) -> None:
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    logs = tmp_path_factory.mktemp("mooncake")
    ns = NetNS()
    try:
        ns.create()
    except RuntimeError as e:
        pytest.skip(f"cannot create a network namespace: {e}")
    master = MooncakeMaster(ns, logs / "master.log")
    clients: list[Client] = []

    def spawn(name: str, **overrides) -> Client:
        c = Client(ns, master, logs / f"{name}.log", **overrides)
        clients.append(c)
        return c

    try:
        master.start()
        yield ns, master, spawn
    finally:
        for c in clients:  # all at once: each close may wait for its timeout
            c.quit(wait=False)
        for c in clients:
            c.wait()
        master.stop()
        ns.delete()


def test_round_trip_exists_and_corruption(cluster):
    _, _, spawn = cluster
    a = spawn("a")
    assert a.hello["connected"]
    assert a("set", first=0, n=12, layout="page_first")["stored"] == 12
    assert a("exists", first=0, n=12)["n"] == 12
    assert a("exists", first=0, n=20)["n"] == 12  # leading keys only
    assert a("exists", first=12, n=4)["n"] == 0
    r = a("get", first=0, n=12, layout="layer_first")
    assert r == {**r, "loaded": 12, "equal": True}
    r = a("get", first=0, n=14, layout="page_first")  # stops at the first miss
    assert r["loaded"] == 12 and r["equal"]
    assert a("set", first=0, n=4, layout="layer_first")["stored"] == 4  # put on existing keys is fine
    assert a("corrupt", first=5, n=1)["ok"]
    r = a("get", first=0, n=12)
    assert r["loaded"] == 5 and r["equal"]  # the flipped page is not served
    st = a("stats")
    assert st["corrupt"] == 1 and st["backend.errors"] == 0
    assert st["hits"] == 12 + 12 + 5 and st["bytes_written"] == 16 * (64 + 8192)
    assert a("exists", first=5, n=1)["n"] == 0  # the corrupt value was dropped
    assert a("set", first=5, n=1)["stored"] == 1
    assert a("get", first=0, n=12)["loaded"] == 12


def test_two_clients_share_pages(cluster):
    _, _, spawn = cluster
    a, b = spawn("writer"), spawn("reader", global_segment_mb=16)
    assert a("set", first=100, n=16)["stored"] == 16
    assert b("exists", first=100, n=16)["n"] == 16
    r = b("get", first=100, n=16, layout="page_first")
    assert r["loaded"] == 16 and r["equal"]
    assert b("stats")["backend.errors"] == 0
    # and the other way round, while both are alive
    assert b("set", first=120, n=4)["stored"] == 4
    r = a("get", first=120, n=4)
    assert r["loaded"] == 4 and r["equal"]


def test_reads_never_queue_behind_a_write(cluster):
    """A write-back's transfer that does not end (held inside the real client) does not stop a
    read: reads and writes run on separate lanes. Before, every call waited on one I/O thread."""
    _, _, spawn = cluster
    a = spawn("lanes", timeout_s=60.0)
    assert a("set", first=400, n=8)["stored"] == 8
    r = a("get_during_held_write", first=400, n=8, wn=8, timeout=120)
    assert r["held"] and r["read_while_held"], r
    assert r["loaded"] == 8 and r["equal"] and r["stored"] == 8, r
    st = a("stats")
    assert st["backend.errors"] == 0 and st["backend.timeouts"] == 0, st


def _settled_set(c: Client, first: int, n: int, attempts: int = 5) -> int:
    """Pages stored by ``set``, retried while the cluster settles after a master restart.

    The module's clients from earlier tests re-mount their segments on the new master a few
    seconds after it starts, each on its own ping; a put the master places on a segment in
    the middle of that fails for those keys (seen once in CI: 2 of 4 stored). That is the
    store being a cache, and the backend reports it (False, an error, a reconnect); a put
    on a key already stored keeps it, so the retry re-sends only what is missing."""
    stored = 0
    for _ in range(attempts):
        assert c("wait_connected", within=20)["connected"]
        stored = c("set", first=first, n=n)["stored"]
        if stored == n:
            break
        time.sleep(1.0)
    return stored


def test_master_down_gives_fast_misses_and_reconnects(cluster):
    _, master, spawn = cluster
    a = spawn("faults")
    assert a("set", first=200, n=8)["stored"] == 8
    master.stop()
    time.sleep(0.2)
    for op, kw, key in (
        ("exists", {}, "n"),
        ("get", {}, "loaded"),
        ("set", {}, "stored"),
        ("exists", {}, "n"),
    ):
        r = a(op, first=200, n=8, **kw)
        assert r[key] == 0, (op, r)
        assert r["ms"] < 1500, f"{op} took {r['ms']:.0f} ms with the master down"
    st = a("stats")
    assert st["backend.errors"] >= 1 and st["backend.connected"] == 0
    assert st["backend.unavailable"] >= 1  # later calls were refused at once
    # a client started while the master is down comes up disconnected, without raising
    b = spawn("late")
    assert b.hello["connected"] is False and b.hello["ms"] < 8000
    assert b("exists", first=200, n=1)["n"] == 0
    master.start()
    assert a("wait_connected", within=20)["connected"]
    assert b("wait_connected", within=20)["connected"]
    # the restarted master knows nothing: write again, then both read
    assert _settled_set(a, first=200, n=8) == 8
    r = b("get", first=200, n=8)
    assert r["loaded"] == 8 and r["equal"]
    assert _settled_set(b, first=300, n=4) == 4
    r = a("get", first=300, n=4)
    assert r["loaded"] == 4 and r["equal"]
    assert a("stats")["backend.reconnects"] >= 1


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "client":
    _client(json.loads(sys.argv[2]))
