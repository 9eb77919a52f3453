"""Connection machinery of the Mooncake storage backend (split out of mooncake_store.py to
keep files small): its config, the I/O thread, the client wrapper, and the mixin that runs
calls with a timeout, marks the backend down, probes the master and reconnects with backoff.

See mooncake_store.py for the fault model (timeouts, backoff, when ``setup`` is retried).
"""

from __future__ import annotations

import queue
import socket
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from hicache.tiers.base import StagingBuffer


@dataclass(frozen=True)
class MooncakeConfig:
    """Options of :class:`MooncakeStore` (the keys of its config mapping)."""

    master_server_address: str = "127.0.0.1:50051"
    metadata_server: str = "http://127.0.0.1:8080/metadata"
    local_hostname: str = ""  # "": the address of the interface that routes to the master
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_mb: int = 4096  # memory this client contributes to the store
    local_buffer_mb: int = 64
    key_prefix: str = "hicache/"
    timeout_s: float = 2.0
    setup_timeout_s: float = 10.0
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    resetup_after: int = 5

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.setup_timeout_s <= 0 or self.backoff_s <= 0:
            raise ValueError("timeouts and backoff must be positive")
        if self.global_segment_mb < 0 or self.local_buffer_mb <= 0:
            raise ValueError("global_segment_mb must be >= 0 and local_buffer_mb > 0")
        if ":" not in self.master_server_address:
            raise ValueError(f"master_server_address must be host:port, got {self.master_server_address!r}")

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> MooncakeConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(config) - known
        if unknown:
            raise ValueError(f"unknown mooncake storage options {sorted(unknown)}; known: {sorted(known)}")
        return cls(**config)


def _route_address(host_port: str) -> str:
    """The local address the kernel would use to reach ``host:port`` (no packet is sent)."""
    host, _, port = host_port.rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port)))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class _IOThread:
    """One daemon thread running submitted calls in order (daemon: a hung call never
    blocks interpreter exit, unlike ThreadPoolExecutor's workers)."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._q.put((fut, fn))
        return fut

    def stop(self) -> None:
        self._q.put(None)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(e)


class _Client:
    """One set-up ``MooncakeDistributedStore`` with its two I/O lanes and registered buffers:
    ``io`` runs reads (and setup, probes, removals of single keys' values), ``io_write`` runs
    writes and removals, so a read never queues behind a write-back's large ``batch_put_from``
    (the client takes calls from several threads at once, as SGLang's prefetch and backup
    threads make them)."""

    def __init__(self, store: Any, io: _IOThread, io_write: _IOThread | None = None) -> None:
        self.store = store
        self.io = io
        self.io_write = io_write or _IOThread("mooncake-write")
        self.registered: dict[int, int] = {}  # ptr -> size (under reg_lock: both lanes register)
        self.reg_lock = threading.Lock()
        self.stuck = 0  # calls that timed out and have not ended yet

    def lane(self, write: bool) -> _IOThread:
        return self.io_write if write else self.io

    def retire(self) -> None:
        """Close in the background (a close can take seconds when the master is gone)."""
        self.close_later()

    def close_later(self) -> Future:
        """Stop both lanes; the store is closed on the read lane once the writes queued before
        have ended (so no transfer runs on a closed client). Returns the close's future."""
        writes_done = self.io_write.submit(lambda: None)
        self.io_write.stop()

        def close():
            writes_done.exception()  # waits for the write lane's earlier calls
            try:
                self.store.close()
            except Exception:  # noqa: BLE001
                pass

        fut = self.io.submit(close)
        self.io.stop()
        return fut


class _MooncakeConnection:
    """Connection state and calls of :class:`hicache.tiers.mooncake_store.MooncakeStore`; the
    attributes below are set by ``MooncakeStore.__init__``."""

    config: MooncakeConfig
    _factory: Callable[[], Any]
    _lock: threading.Lock
    _client: _Client | None
    _healthy: bool
    _closed: bool
    _reconnecting: bool
    _wake: threading.Event
    _counts: dict[str, int]

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _call(self, fn: Callable[[_Client], Any], buf: StagingBuffer | None = None, write: bool = False) -> Any:
        """Run ``fn(client)`` on the client's read lane (``write``: its write lane), waiting at
        most ``timeout_s``; None when down, failed or timed out (counted)."""
        with self._lock:
            client = self._client if self._healthy else None
        if client is None:
            self._count("unavailable")
            return None

        def job():
            try:
                if buf is not None:
                    with client.reg_lock:
                        if client.registered.get(buf.ptr) != buf.nbytes:
                            self._register(client, buf)
                return fn(client)
            finally:
                if buf is not None:
                    buf.release()  # before the waiter wakes: the buffer is free again

        if buf is not None:
            buf.acquire()
        fut = client.lane(write).submit(job)
        try:
            return fut.result(timeout=self.config.timeout_s)
        except FutureTimeout:
            with self._lock:
                client.stuck += 1
            fut.add_done_callback(lambda _f: self._unstick(client))
            self._count("timeouts")
            self._failed()
        except Exception:  # noqa: BLE001 - a client exception is a store failure
            self._failed()
        return None

    def _unstick(self, client: _Client) -> None:
        with self._lock:
            client.stuck -= 1

    def _register(self, client: _Client, buf: StagingBuffer) -> None:
        """On an I/O lane, under ``client.reg_lock``: register ``buf`` with ``client`` (once),
        unregister when it dies."""
        old = client.registered.pop(buf.ptr, None)
        if old is not None:  # a dead buffer's address reused with another size
            client.store.unregister_buffer(buf.ptr)
        if client.store.register_buffer(buf.ptr, buf.nbytes) == 0:
            client.registered[buf.ptr] = buf.nbytes
            ref = weakref.ref(client)
            weakref.finalize(buf, _unregister_later, ref, buf.ptr)

    def _failed(self) -> None:
        self._count("errors")
        self._mark_down()

    def _mark_down(self) -> None:
        with self._lock:
            self._healthy = False
            if self._reconnecting or self._closed:
                return
            self._reconnecting = True
        threading.Thread(target=self._reconnect_loop, name="mooncake-reconnect", daemon=True).start()

    def _reconnect_loop(self) -> None:
        cfg = self.config
        backoff, probes_failed = cfg.backoff_s, 0
        try:
            while not self._closed:
                self._wake.wait(backoff)
                if self._closed:
                    return
                client = self._client
                rc = None
                if client is not None and not client.stuck:
                    fut = client.io.submit(client.store.health_check)
                    try:
                        rc = fut.result(timeout=cfg.timeout_s)
                    except Exception:  # noqa: BLE001
                        rc = None
                    if rc == 0:
                        with self._lock:
                            self._healthy = not self._closed
                        self._count("reconnects")
                        return
                    probes_failed += 1
                if client is None or client.stuck or rc == 1 or probes_failed >= cfg.resetup_after:
                    new = self._setup_client()
                    if new is not None:
                        with self._lock:
                            old, self._client = self._client, new
                            self._healthy = not self._closed
                        if old is not None:
                            old.retire()
                        self._count("reconnects")
                        return
                    probes_failed = 0
                backoff = min(backoff * 2, cfg.max_backoff_s)
        finally:
            with self._lock:
                self._reconnecting = False

    def _master_reachable(self) -> bool:
        """TCP probes of the master and the HTTP metadata server (Python sockets, bounded)."""
        cfg = self.config
        targets = [cfg.master_server_address]
        meta = urlsplit(cfg.metadata_server)
        if meta.scheme in ("http", "https") and meta.hostname:
            targets.append(f"{meta.hostname}:{meta.port or (443 if meta.scheme == 'https' else 80)}")
        for hp in targets:
            host, _, port = hp.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=min(1.0, cfg.setup_timeout_s)).close()
            except (OSError, ValueError):
                return False
        return True

    def _setup_client(self) -> _Client | None:
        """A freshly set-up client, or None (master unreachable, setup failed or took over
        ``setup_timeout_s``).

        ``setup`` holds the GIL while it runs (about 1 s with a live master; with a dead one
        it retries for about 90 s), so it is only called after the master and the
        metadata server answered a TCP probe, and only at construction or when the
        client is unusable -- a client that loses its master recovers without a new setup.
        """
        cfg = self.config
        if not self._master_reachable():
            self._count("errors")
            return None
        self._count("setups")
        io = _IOThread("mooncake-io")
        host = cfg.local_hostname or _route_address(cfg.master_server_address)

        def setup():
            store = self._factory()
            rc = store.setup(
                host,
                cfg.metadata_server,
                cfg.global_segment_mb << 20,
                cfg.local_buffer_mb << 20,
                cfg.protocol,
                cfg.device_name,
                cfg.master_server_address,
            )
            return store, rc

        fut = io.submit(setup)
        try:
            store, rc = fut.result(timeout=cfg.setup_timeout_s)
        except Exception:  # noqa: BLE001 - timeout or a client exception
            io.stop()
            self._count("errors")
            return None
        if rc != 0:
            client = _Client(store, io)
            client.retire()
            self._count("errors")
            return None
        return _Client(store, io)


def _unregister_later(client_ref: weakref.ref, ptr: int) -> None:
    client = client_ref()
    if client is None:
        return

    def job():
        with client.reg_lock:
            if client.registered.pop(ptr, None) is not None:
                client.store.unregister_buffer(ptr)

    client.io.submit(job)
