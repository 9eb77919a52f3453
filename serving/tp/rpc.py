"""Rank 0's requests to a follower that are not commands (L3 reads and writes, integrity
checks): concurrent, matched to their answers by id.

Concurrency contract: ``RpcClient.call`` may be called from any thread (sends are locked; one
reader thread per follower resolves the futures); ``serve_rpc`` (the follower's request thread)
runs each request on a small pool, so one slow L3 read does not hold up the others, and sends
each answer as it is ready.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any


class RankGone(RuntimeError):
    """The follower's pipe closed while a request was pending (rank 0's monitor stops the engine)."""


class RpcClient:
    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn, self.rank = conn, rank
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name=f"tp-rpc{rank}", daemon=True).start()

    def call(self, request: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            rid = next(self._ids)
            self._pending[rid] = fut
            try:
                self.conn.send((rid, request))
            except OSError:
                self._pending.pop(rid)
                fut.set_exception(RankGone(f"tensor-parallel rank {self.rank} is gone"))
        return fut

    def _read(self) -> None:
        while True:
            try:
                rid, answer = self.conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                fut = self._pending.pop(rid, None)
            if fut is not None:
                fut.set_result(answer)
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(RankGone(f"tensor-parallel rank {self.rank} is gone"))


def serve_rpc(conn: Connection, handle: Callable[[Any], Any], workers: int) -> None:
    """Answer ``(id, request)`` pairs from ``conn`` with ``handle(request)`` until it closes."""
    lock = threading.Lock()

    def run(rid: int, request: Any) -> None:
        answer = handle(request)
        with lock:
            conn.send((rid, answer))

    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="tp-rpc") as pool:
        while True:
            try:
                rid, request = conn.recv()
            except (EOFError, OSError):
                return
            pool.submit(run, rid, request)
