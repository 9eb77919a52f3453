"""The connection of the Mooncake backend: calls with a timeout, marking the backend down,
probing the master and reconnecting with backoff (the fault model is in
:mod:`hicache.tiers.mooncake.store`)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any
from urllib.parse import urlsplit

from hicache.tiers.base import StagingBuffer
from hicache.tiers.mooncake.config import MooncakeConfig, route_address
from hicache.tiers.mooncake.lanes import IOLane, MooncakeClient


class MooncakeConnection:
    """The current :class:`MooncakeClient` (or none), whether it is usable, and the counters
    of one :class:`~hicache.tiers.mooncake.store.MooncakeStore`. Built with the client factory
    (``MooncakeDistributedStore`` or a test's); sets up a client at once, or starts down and
    reconnects in the background (a master that is down is not an error).

    Contract:
    - :meth:`call` may be called from any number of threads at once; it runs the call on the
      client's read lane (or write lane) and waits at most ``timeout_s``: it never raises for a
      store failure and never waits on a reconnect (while down it returns None at once).
    - ``_lock`` guards ``_client``, ``_healthy``, ``_closed``, ``_reconnecting``, ``_counts``
      and each client's ``stuck``; it is never held across a call, a probe or a setup.
    - At most one reconnect thread (``mooncake-reconnect``, started by :meth:`failed` when the
      first failure marks the connection down; ``_reconnecting`` says one runs): it sleeps on
      ``_wake`` (backoff; :meth:`close` sets it), probes the current client on its read lane
      or sets up a new one, swaps ``_client`` under ``_lock`` and retires the old one in the
      background. It reads ``_client``/``_closed`` without the lock (one iteration stale at
      worst).
    - :meth:`close` marks closed, drops the client and waits at most ``timeout_s`` for its
      lanes to finish and close it.
    """

    def __init__(self, config: MooncakeConfig, factory: Callable[[], Any]) -> None:
        self.config = config
        self._factory = factory
        self._lock = threading.Lock()
        self._client: MooncakeClient | None = None
        self._healthy = False
        self._closed = False
        self._reconnecting = False
        self._wake = threading.Event()
        self._counts = dict.fromkeys(("errors", "timeouts", "unavailable", "setups", "reconnects"), 0)
        client = self._setup_client()
        if client is not None:
            self._client, self._healthy = client, True
        else:
            self._mark_down()

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def client(self) -> MooncakeClient | None:
        """The current client (None before the first successful setup and after close)."""
        return self._client

    def stats(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._counts)
        out["connected"] = int(self._healthy)
        return out

    def call(self, fn: Callable[[MooncakeClient], Any], buf: StagingBuffer | None = None,
             write: bool = False) -> Any:
        """Run ``fn(client)`` on the client's read lane (``write``: its write lane), waiting at
        most ``timeout_s``; None when down, failed or timed out (counted). ``buf`` (a staging
        buffer the call reads or writes) is registered with the client first and stays marked
        busy until the call really ends, even after a timeout."""
        with self._lock:
            client = self._client if self._healthy else None
        if client is None:
            self._count("unavailable")
            return None

        def job():
            try:
                if buf is not None:
                    client.ensure_registered(buf)
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
            self.failed()
        except Exception:  # noqa: BLE001 - a client exception is a store failure
            self.failed()
        return None

    def failed(self) -> None:
        """A call failed (or answered with a failure code): count it, mark down, reconnect."""
        self._count("errors")
        self._mark_down()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client, self._healthy = self._client, None, False
        self._wake.set()
        if client is not None:
            fut = client.close_later()
            try:
                fut.result(timeout=self.config.timeout_s)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass

    # ------------------------------------------------------------------ internals
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _unstick(self, client: MooncakeClient) -> None:
        with self._lock:
            client.stuck -= 1

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

    def _setup_client(self) -> MooncakeClient | None:
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
        io = IOLane("mooncake-io")
        host = cfg.local_hostname or route_address(cfg.master_server_address)

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
            client = MooncakeClient(store, io)
            client.retire()
            self._count("errors")
            return None
        return MooncakeClient(store, io)
