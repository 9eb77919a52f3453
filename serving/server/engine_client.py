"""The HTTP process's side of the engine: spawns the engine process and talks to it.

Two threads move frames so that neither a slow engine step nor a full pipe ever blocks the
event loop: the writer sends queued messages in order, the reader hands decoded frames to
the loop (``call_soon_threadsafe``). Each request gets a :class:`ReqHandle` whose state keeps
the cumulative output ids; closing a handle before its request finished aborts it in the
engine, which frees its pages.

Every wait on the engine is bounded, and fails at once with 503 while the watchdog
(serving.server.watchdog) sees the engine stalled: no progress for ``watchdog_timeout`` seconds
with work pending, or its loop not turning for that long (frozen). A control call fails with 504
after ``engine_call_timeout_s`` (the engine then drops it unrun). A request waits at most
``engine_call_timeout_s`` for the engine to acknowledge receipt (``Received``, sent by the
engine's receiver thread even mid forward pass), then for its acceptance or refusal for as long
as the engine makes progress: one queued behind a long prefill chunk is not failed with a 504,
and a 503 ends the wait once the watchdog trips. The watch task (``watch``) logs the moment the
watchdog trips and the moment the engine moves again.

Detokenization happens here, in the HTTP process (serving.server.text): the engine process
only moves ids, so its step loop is never slowed by string work, and the tokenizer that
applied the chat template is the one that decodes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from serving import ipc as m
from serving.config import EngineConfig
from serving.engine.main import engine_main
from serving.scoped_ids import unscoped
from serving.server.config import ServerConfig
from serving.server.errors import APIError, quoted
from serving.server.metrics import ServerMetrics
from serving.server.req_handle import ReqHandle
from serving.server.watchdog import silence_seconds, stall_seconds

log = logging.getLogger("hicache.server")
ACCEPT_POLL_S = 0.25  # how often a request waiting for its acceptance checks the watchdog


class EngineStartError(RuntimeError):
    """The engine process did not start; ``status`` 400: a flag this machine cannot serve (one line)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class EngineClient:
    """The engine process and the two pipes to it, as the HTTP process sees them.

    Concurrency contract. Threads: the asyncio event loop owns ``handles``, ``calls``,
    ``alive``, ``_waiting_since`` and ``watchdog_tripped`` (the routes, :meth:`submit`,
    :meth:`call`, :meth:`watch`, and ``_dispatch`` / ``_on_engine_gone``, which the reader
    posts to it with ``call_soon_threadsafe``); the ``engine-writer`` thread takes frames from
    ``_outbox`` (a thread-safe queue; ``None`` stops it) and is the only writer of the pipe to
    the engine once attached; the ``engine-reader`` thread blocks on the pipe from the engine
    and touches nothing but the loop it posts to. No lock: nothing is shared but the queue and
    ``call_soon_threadsafe``. :meth:`spawn`, :meth:`wait_ready` (blocks, polling the pipe, up
    to its timeout) and :meth:`stop` (blocks up to ``shutdown_timeout_s`` for the engine to
    persist and exit) run before the loop serves / after it stopped. Waits on the event loop
    are bounded (see the module docstring): a request's acceptance, a control call's answer.
    """

    def __init__(self, engine: EngineConfig, server: ServerConfig, metrics: ServerMetrics | None) -> None:
        self.engine_config, self.server_config = engine, server
        self.metrics = metrics
        self.info: dict[str, Any] = {}
        self.handles: dict[str, ReqHandle] = {}
        self.calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.alive = False
        self.started_at = time.time()
        self.proc: mp.process.BaseProcess | None = None
        self.on_gone: Callable[[], None] | None = None  # called if the engine dies while serving
        self.heartbeat: m.Heartbeat | None = None  # the engine's watchdog heartbeat (shared memory), set by spawn
        self._waiting_since: float | None = None  # since when handles or calls have been pending
        self.watchdog_tripped = False  # the watchdog task's last verdict (it logs the changes)

    # -- lifecycle -------------------------------------------------------------------------
    def spawn(self) -> None:
        """Start the engine process (returns at once; see ``wait_ready``)."""
        ctx = mp.get_context("spawn")
        self._rx_engine, self._tx_http = ctx.Pipe(duplex=False)  # http -> engine
        self._rx_http, self._tx_engine = ctx.Pipe(duplex=False)  # engine -> http
        self.heartbeat = m.make_heartbeat(ctx)
        self.proc = ctx.Process(
            target=engine_main,
            name="hicache-engine",
            args=(self.engine_config, self.server_config.engine_process(), self._rx_engine, self._tx_engine,
                  self.heartbeat),
        )
        self.proc.start()
        self._rx_engine.close()
        self._tx_engine.close()

    def wait_ready(self, timeout: float = 600.0) -> dict[str, Any]:
        """Block until the engine process reports Ready; raise EngineStartError if it fails."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while not self._rx_http.poll(0.2):
            if not self.proc.is_alive():
                raise EngineStartError(f"engine process exited with code {self.proc.exitcode} while starting")
            if time.monotonic() > deadline:
                raise EngineStartError(f"engine not ready after {timeout:.0f} s")
        try:
            first = m.decode(self._rx_http.recv_bytes())[0]
        except EOFError:
            raise EngineStartError("engine process exited while starting") from None
        if isinstance(first, m.Error):
            raise EngineStartError(first.message, first.status)
        assert isinstance(first, m.Ready)
        self.info = first.info
        self.alive = True
        self.started_at = time.time()
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the I/O threads; replies are delivered on ``loop``."""
        self.loop = loop
        threading.Thread(target=self._write_loop, name="engine-writer", daemon=True).start()
        threading.Thread(target=self._read_loop, name="engine-reader", daemon=True).start()

    # -- watchdog --------------------------------------------------------------------------
    def _stall_parts(self) -> tuple[float, float]:
        """(no progress with work pending, loop silent), in seconds; (0, 0) once not alive."""
        if not self.alive:
            return 0.0, 0.0
        if self._waiting_since is not None and not self.handles and not self.calls:
            self._waiting_since = None
        return stall_seconds(self.heartbeat, self._waiting_since), silence_seconds(self.heartbeat)

    def stall_s(self) -> float:
        """Seconds the engine has made no progress while work is pending, or its loop has not
        turned (whichever is longer; an idle healthy engine's loop turns about once a second)."""
        return max(self._stall_parts())

    @property
    def stalled(self) -> bool:
        return self.stall_s() > self.server_config.watchdog_timeout

    def stall_message(self) -> str:
        pending, silent = self._stall_parts()
        why = ("with work pending" if pending >= silent else
               "its loop has not turned: frozen, or in one forward pass longer than that")
        return (f"the engine has made no progress for {max(pending, silent):.0f} s ({why}) "
                f"(watchdog_timeout={self.server_config.watchdog_timeout:g} s)")

    async def watch(self, period_s: float = 0.5) -> None:
        """Log when the watchdog trips and when the engine recovers (runs until cancelled)."""
        while True:
            await asyncio.sleep(period_s)
            tripped = self.stalled
            if tripped and not self.watchdog_tripped:
                pending = len(self.handles) + len(self.calls)
                log.error("engine watchdog: %s, %d request(s) or call(s) waiting; /health answers 503",
                          self.stall_message(), pending)
            elif self.watchdog_tripped and not tripped and self.alive:
                log.warning("engine watchdog: the engine makes progress again; /health answers 200")
            self.watchdog_tripped = tripped

    def _start_waiting(self) -> None:
        """Call before adding a handle or a call: starts the stall clock if nothing was pending."""
        if not self.handles and not self.calls:
            self._waiting_since = time.monotonic()

    def stop(self, timeout: float | None = None) -> int | None:
        """Ask the engine process to exit and wait for it: with L3 it first writes every cached
        page on to L3 and logs how many it could not write. Past ``timeout`` (default: the
        server's ``shutdown_timeout_s``) it is killed. Returns its exit code."""
        if self.proc is None:
            return None
        if timeout is None:
            timeout = self.server_config.shutdown_timeout_s
        self.alive = False
        if self.proc.is_alive():
            if self.loop is not None:
                self.send(m.Shutdown())
                self._outbox.put(None)
            else:
                try:
                    self._tx_http.send_bytes(m.encode([m.Shutdown()]))
                except OSError:
                    pass
            persists = self.engine_config.cache.storage_enabled and bool(self.info)  # it served: it has a cache
            if persists:
                log.info("waiting up to %.0f s (shutdown_timeout_s) for the engine to persist its cache to L3",
                         timeout)
            self.proc.join(timeout)
            if self.proc.is_alive():
                log.error(
                    "the engine process did not finish its shutdown within shutdown_timeout_s=%.0f s; killing it%s",
                    timeout, " (cached pages not yet written to L3 are lost)" if persists else "")
                self.proc.terminate()
                self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self.alive = False
        return self.proc.exitcode

    # -- I/O threads -----------------------------------------------------------------------
    def send(self, msg: m.Message) -> None:
        """Queue a message for the engine (packed here, so a bad value fails in the caller)."""
        try:
            data = m.pack(msg)
        except (TypeError, ValueError, OverflowError) as e:
            raise APIError(400, f"a value in the request cannot be encoded: {e}") from None
        self._outbox.put(data)

    def _write_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            batch = [msg]
            while True:  # coalesce whatever is already queued into one frame
                try:
                    nxt = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._outbox.put(None)
                    break
                batch.append(nxt)
            try:
                self._tx_http.send_bytes(b"".join(batch))
            except OSError:
                return

    def _read_loop(self) -> None:
        while True:
            try:
                msgs = m.decode(self._rx_http.recv_bytes())
            except (EOFError, OSError):
                self._post(self._on_engine_gone)
                return
            self._post(self._dispatch, msgs)

    def _post(self, fn: Any, *args: Any) -> None:
        assert self.loop is not None
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass

    def _dispatch(self, msgs: list[m.Message]) -> None:
        for msg in msgs:
            if isinstance(msg, m.Received):
                for rid in msg.rids:
                    received = self.handles.get(rid)
                    if received is not None:
                        received.received = True
                continue
            call_id = getattr(msg, "call_id", None)
            if call_id is not None:
                fut = self.calls.pop(call_id, None)
                if fut is not None and not fut.done():
                    if isinstance(msg, m.Error):
                        fut.set_exception(APIError(msg.status, msg.message))
                    else:
                        fut.set_result(msg.value)  # type: ignore[union-attr]
                continue
            handle = self.handles.get(getattr(msg, "rid", None) or "")
            if handle is not None:
                handle.queue.put_nowait(msg)

    def _on_engine_gone(self) -> None:
        unexpected = self.alive
        self.alive = False
        if unexpected:
            log.error("the engine process is gone; the server shuts down")
            if self.on_gone is not None:
                self.on_gone()
        err = m.Error(503, "the engine process is not running")
        for handle in list(self.handles.values()):
            handle.queue.put_nowait(m.Error(err.status, err.message, rid=handle.rid))
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(APIError(err.status, err.message))
        self.calls.clear()

    # -- API -------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if not self.alive:
            raise APIError(503, "the engine process is not running")
        if self.stalled:
            raise APIError(503, self.stall_message())

    async def submit(self, req: m.GenerateReq) -> ReqHandle:
        """Send a request; return once the engine accepted it (raises APIError otherwise)."""
        self._check_alive()
        if req.rid in self.handles:  # rids are per tenant (serving/scoped_ids.py): only the caller's own
            raise APIError(400, f"a request with rid {quoted(unscoped(req.rid))} is already running", param="rid")
        self._start_waiting()
        handle = ReqHandle(self, req.rid)
        self.handles[req.rid] = handle
        try:
            self.send(req)
            handle.apply(await self._acceptance(handle))
        except BaseException:
            handle.close()  # aborts it in the engine, should it accept it later
            raise
        return handle

    async def _acceptance(self, handle: ReqHandle) -> m.Message:
        """The engine's first answer to a request: its acceptance TokenOut, or an Error. Before
        the engine acknowledged receipt: 504 past ``engine_call_timeout_s``; after: no limit
        while the engine makes progress, 503 once the watchdog trips."""
        timeout = self.server_config.engine_call_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            wait = ACCEPT_POLL_S if handle.received else min(ACCEPT_POLL_S, deadline - time.monotonic())
            try:
                return await asyncio.wait_for(handle.queue.get(), max(wait, 0.0))
            except TimeoutError:
                pass
            if handle.received:
                if self.stalled:
                    raise APIError(503, self.stall_message())
            elif time.monotonic() >= deadline:
                raise APIError(504, f"the engine did not accept the request within {timeout:g} s "
                                    "(engine_call_timeout_s); it may be stalled")

    async def call(self, msg_type: type, timeout: float | None = None, **kwargs: Any) -> Any:
        """A control call: its result, or APIError (503 when the engine is gone or stalled,
        504 when it did not answer within ``timeout``, default ``engine_call_timeout_s``;
        the engine then drops the call unrun)."""
        self._check_alive()
        assert self.loop is not None
        timeout = self.server_config.engine_call_timeout_s if timeout is None else timeout
        self._start_waiting()
        call_id = next(self._call_ids)
        fut = self.loop.create_future()
        self.calls[call_id] = fut
        try:
            self.send(msg_type(call_id=call_id, deadline=time.monotonic() + timeout, **kwargs))
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise APIError(504, f"the engine did not answer {msg_type.__name__} within {timeout:g} s "
                                "(engine_call_timeout_s); it may be stalled") from None
        finally:
            self.calls.pop(call_id, None)
