"""Mooncake Store backend of the storage tier (distributed; for many serving nodes).

Uses ``mooncake.store.MooncakeDistributedStore`` (pip ``mooncake-transfer-engine-non-cuda``
on CPU machines, which needs Debian's ``libibverbs1 ibverbs-providers``; the CUDA build
``mooncake-transfer-engine`` on GPU machines) over TCP (or RDMA via ``protocol``/``device_name``).

Calls used:
- data path, zero-copy from/into the tier's staging buffers, registered once per buffer
  and client with ``register_buffer``: ``batch_put_from`` (set), ``batch_get_into`` (get),
  ``batch_is_exist`` (exists);
- bytes path (single-key API and tools): ``put`` / ``get`` / ``put_batch`` / ``get_batch``;
- ``batch_remove(force=True)`` / ``remove_by_regex(^prefix, force=True)``: delete / clear
  (force, because a key read recently is leased and a plain remove fails with -706);
- ``health_check`` for reconnect probes.

Semantics to keep in mind (see /work/shared/MOONCAKE.md): values live in the segments
the clients mount (``global_segment_mb`` from this one; the master picks the segment,
not necessarily the writer's): values go away with the client whose segment holds them,
the master evicts silently near its high watermark, and a restarted master knows
nothing -- the store is a cache, never the only copy. ``put`` on an existing key
keeps the old value (equal keys mean equal values; corrupt values are deleted by the
tier before a rewrite). Errors are return codes; a missing key reads as ``b''``.

Faults: every call runs on this backend's I/O thread (the data calls release the GIL)
and is waited for at most
``timeout_s``. A failed or timed-out call counts an error, marks the backend down and
returns misses / ``False``; while down, calls return at once (counted ``unavailable``)
and a background thread probes the master (``health_check``) with exponential backoff
(``backoff_s`` .. ``max_backoff_s``), rebuilding the client (a fresh ``setup``, tried
only once the master answers a TCP probe: ``setup`` holds the GIL for ~1 s, ~90 s when
the master is dead) when it was never set up, when a call is stuck, or after
``resetup_after`` failed probes. A
timed-out transfer keeps its :class:`StagingBuffer` marked busy until it really ends, so
it can never write into memory reused meanwhile. Nothing raises into the serving path;
only the constructor raises (``ImportError`` without the package, ``ValueError`` for bad
options) -- a master that is down at construction is not an error (the backend starts down).

Thread-safety: any number of threads may call; calls are serialised on the I/O thread.
"""

from __future__ import annotations

import queue
import re
import socket
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from hicache.tiers.base import ERROR, MISSING, TOO_LARGE, Buffer, StagingBuffer, StorageBackend, _same_len

# Return codes of the Mooncake client that are answers, not failures.
OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600
_SENTINEL = object()


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
    """One set-up ``MooncakeDistributedStore`` with its I/O thread and registered buffers."""

    def __init__(self, store: Any, io: _IOThread) -> None:
        self.store = store
        self.io = io
        self.registered: dict[int, int] = {}  # ptr -> size (touched on the I/O thread only)
        self.stuck = 0  # calls that timed out and have not ended yet

    def retire(self) -> None:
        """Close in the background (a close can take seconds when the master is gone)."""
        def close():
            try:
                self.store.close()
            except Exception:  # noqa: BLE001
                pass

        self.io.submit(close)
        self.io.stop()


class MooncakeStore(StorageBackend):
    """See the module docstring. ``store_factory`` (tests, tools) builds the client object."""

    name = "mooncake"

    def __init__(self, config: MooncakeConfig, store_factory: Callable[[], Any] | None = None) -> None:
        if store_factory is None:
            try:
                from mooncake.store import MooncakeDistributedStore
            except ImportError as e:
                raise ImportError(
                    "the mooncake storage backend needs `pip install mooncake-transfer-engine-non-cuda` "
                    "(CPU; plus `apt-get install -y libibverbs1 ibverbs-providers`) or "
                    "`mooncake-transfer-engine` (CUDA)"
                ) from e
            store_factory = MooncakeDistributedStore
        self.config = config
        self._factory = store_factory
        self._prefix = config.key_prefix
        self._lock = threading.Lock()
        self._client: _Client | None = None
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

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | MooncakeConfig) -> MooncakeStore:
        return cls(config if isinstance(config, MooncakeConfig) else MooncakeConfig.from_mapping(config))

    # ------------------------------------------------------------------ API
    @property
    def connected(self) -> bool:
        return self._healthy

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str) -> bytes | None:
        return self.batch_get([key])[0]

    def set(self, key: str, value: Buffer) -> bool:
        return self.batch_set([key], [value])[0]

    def delete(self, key: str) -> bool:
        res = self._call(lambda c: c.store.batch_remove([self._prefix + key], True))
        return bool(res) and res[0] == 0

    def clear(self) -> None:
        if self._prefix:
            pattern = "^" + re.escape(self._prefix)
            self._call(lambda c: c.store.remove_by_regex(pattern, True))
        else:
            self._call(lambda c: c.store.remove_all(True))

    def batch_exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        full = [self._prefix + k for k in keys]
        res = self._call(lambda c: c.store.batch_is_exist(full))
        if res is None:
            return 0
        n = 0
        for r in res:
            if r != 1:
                if r < 0:
                    self._failed()
                break
            n += 1
        return n

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        full = [self._prefix + k for k in keys]
        res = self._call(lambda c: c.store.get_batch(full))
        if res is None or len(res) != len(keys):
            return [None] * len(keys)
        return [bytes(v) if len(v) else None for v in res]

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        _same_len(keys, values)
        if not keys:
            return []
        full = [self._prefix + k for k in keys]
        vals = [memoryview(v).cast("B") for v in values]
        res = self._call(lambda c: [c.store.put(k, v) for k, v in zip(full, vals, strict=True)])
        return self._set_results(res, len(keys))

    def batch_get_into(
        self, keys: Sequence[str], buf: StagingBuffer, spans: Sequence[tuple[int, int]]
    ) -> list[int]:
        _same_len(keys, spans)
        if not keys:
            return []
        self._check_spans(buf, spans)
        full = [self._prefix + k for k in keys]
        ptrs = [buf.ptr + off for off, _ in spans]
        sizes = [size for _, size in spans]
        res = self._call(lambda c: c.store.batch_get_into(full, ptrs, sizes), buf)
        if res is None or len(res) != len(keys):
            return [ERROR] * len(keys)
        out, failed = [], False
        for r in res:
            if r >= 0:
                out.append(r)
            elif r == OBJECT_NOT_FOUND:
                out.append(MISSING)
            elif r == BUFFER_TOO_SMALL:
                out.append(TOO_LARGE)
            else:
                out.append(ERROR)
                failed = True
        if failed:
            self._failed()
        return out

    def batch_set_from(
        self, keys: Sequence[str], buf: StagingBuffer, spans: Sequence[tuple[int, int]]
    ) -> list[bool]:
        _same_len(keys, spans)
        if not keys:
            return []
        self._check_spans(buf, spans)
        full = [self._prefix + k for k in keys]
        ptrs = [buf.ptr + off for off, _ in spans]
        sizes = [size for _, size in spans]
        res = self._call(lambda c: c.store.batch_put_from(full, ptrs, sizes), buf)
        return self._set_results(res, len(keys))

    def stats(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._counts)
        out["connected"] = int(self._healthy)
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client, self._healthy = self._client, None, False
        self._wake.set()
        if client is not None:
            fut = client.io.submit(client.store.close)
            client.io.stop()
            try:
                fut.result(timeout=self.config.timeout_s)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass

    # ------------------------------------------------------------------ internals
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _set_results(self, res: list[int] | None, n: int) -> list[bool]:
        if res is None or len(res) != n:
            return [False] * n
        out = [r == 0 for r in res]
        if not all(out):
            self._failed()
        return out

    @staticmethod
    def _check_spans(buf: StagingBuffer, spans: Sequence[tuple[int, int]]) -> None:
        for off, size in spans:
            if off < 0 or size <= 0 or off + size > buf.nbytes:
                raise ValueError(f"span ({off}, {size}) outside a buffer of {buf.nbytes} bytes")

    def _call(self, fn: Callable[[_Client], Any], buf: StagingBuffer | None = None) -> Any:
        """Run ``fn(client)`` on the I/O thread, waiting at most ``timeout_s``; None when
        down, failed or timed out (counted)."""
        with self._lock:
            client = self._client if self._healthy else None
        if client is None:
            self._count("unavailable")
            return None

        def job():
            try:
                if buf is not None and client.registered.get(buf.ptr) != buf.nbytes:
                    self._register(client, buf)
                return fn(client)
            finally:
                if buf is not None:
                    buf.release()  # before the waiter wakes: the buffer is free again

        if buf is not None:
            buf.acquire()
        fut = client.io.submit(job)
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
        """On the I/O thread: register ``buf`` with ``client`` (once), unregister when it dies."""
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
        if client.registered.pop(ptr, None) is not None:
            client.store.unregister_buffer(ptr)

    client.io.submit(job)
