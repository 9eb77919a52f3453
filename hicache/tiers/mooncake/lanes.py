"""The I/O lanes of the Mooncake backend and the wrapper of one set-up client."""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from hicache.tiers.base import StagingBuffer


class IOLane:
    """One daemon thread running submitted calls in order (daemon: a hung call never
    blocks interpreter exit, unlike ThreadPoolExecutor's workers). Any thread may
    :meth:`submit`; :meth:`stop` ends the thread after the calls queued before it."""

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


class MooncakeClient:
    """One set-up ``MooncakeDistributedStore`` with its two I/O lanes and registered buffers:
    ``io`` runs reads (and setup, probes, removals of single keys' values), ``io_write`` runs
    writes and removals, so a read never queues behind a write-back's large ``batch_put_from``
    (the client takes calls from several threads at once, as SGLang's prefetch and backup
    threads make them).

    ``reg_lock`` guards ``registered`` (both lanes register buffers). ``stuck`` (calls that
    timed out and have not ended yet) belongs to the owning
    :class:`~hicache.tiers.mooncake.connection.MooncakeConnection` and changes under its lock.
    """

    def __init__(self, store: Any, io: IOLane, io_write: IOLane | None = None) -> None:
        self.store = store
        self.io = io
        self.io_write = io_write or IOLane("mooncake-write")
        self.registered: dict[int, int] = {}  # ptr -> size (under reg_lock: both lanes register)
        self.reg_lock = threading.Lock()
        self.stuck = 0  # calls that timed out and have not ended yet

    def lane(self, write: bool) -> IOLane:
        return self.io_write if write else self.io

    def ensure_registered(self, buf: StagingBuffer) -> None:
        """On an I/O lane: register ``buf`` with this client (once; again when a dead buffer's
        address is reused with another size), unregistered when ``buf`` dies."""
        with self.reg_lock:
            if self.registered.get(buf.ptr) == buf.nbytes:
                return
            old = self.registered.pop(buf.ptr, None)
            if old is not None:  # a dead buffer's address reused with another size
                self.store.unregister_buffer(buf.ptr)
            if self.store.register_buffer(buf.ptr, buf.nbytes) == 0:
                self.registered[buf.ptr] = buf.nbytes
                weakref.finalize(buf, _unregister_later, weakref.ref(self), buf.ptr)

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


def _unregister_later(client_ref: weakref.ref, ptr: int) -> None:
    client = client_ref()
    if client is None:
        return

    def job():
        with client.reg_lock:
            if client.registered.pop(ptr, None) is not None:
                client.store.unregister_buffer(ptr)

    client.io.submit(job)
