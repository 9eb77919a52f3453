"""The engine process: owns an EngineCore and runs its step loop.

Its entry point is :func:`serving.engine.main.engine_main` (spawned by
:class:`serving.server.engine_client.EngineClient`). It talks over two one-way pipes
(``multiprocessing.connection``): ``rx`` brings messages from the HTTP process, ``tx`` takes replies back.
A receiver thread (serving.engine.inbox) reads ``rx`` and acknowledges each request at
once, even while a forward pass runs; the loop thread, which owns everything else here:

1. takes what the receiver read, without blocking (waits for it, with a timeout, only when
   there is no work);
2. run one ``step()`` when the scheduler has work. A step that raises fails the requests that
   took part in it (a 500 each), gives their pages back and checks the cache's invariants;
   if they cannot be restored, the process exits with status ``EXIT_BROKEN`` (the HTTP process
   then answers 503 and shuts down): a broken tree is never served nor persisted;
3. send each live request's new token ids (and its finish) in one frame;
4. close sessions idle for longer than ``session_idle_timeout_s``;
5. beat the watchdog's heartbeat (serving.engine.heartbeat): the loop went round, and whether
   it made progress (a forward pass, a finished request, or nothing to do).

At shutdown, with L3, every cached page is written on to L3 and the process logs
"persisted N pages to L3, M not written" (see ``shutdown_core``).

A test can hold a step as a long forward pass would (serving.engine.debug_hooks).

Only token ids leave this process: detokenization happens in the HTTP process (see
engine_client), so the step loop spends its time on forward passes, not on string work.

The loop is composed of objects that own their state, each on the loop thread:
:class:`serving.engine.dispatch.Dispatch` (each message to its handler),
:class:`serving.engine.requests.RequestTable` (rids <-> live requests, their outputs, aborts)
with its :class:`serving.engine.requests.Outbox` (one frame per turn), and
:class:`serving.engine.housekeeping.Housekeeping` (session sweep, KV-control turn, heartbeat,
stats). This module holds the turn itself and what a failed step does.
"""

from __future__ import annotations

import logging
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from common.tenants import load_tenants
from serving import ipc as m
from serving.cache.kv_control import ControlLimits, KVControl
from serving.engine.cache_events import CacheEventLog
from serving.engine.debug_hooks import StepHold
from serving.engine.dispatch import Dispatch
from serving.engine.housekeeping import SESSION_SWEEP_S, Housekeeping
from serving.engine.inbox import EngineInbox
from serving.engine.requests import Outbox, RequestTable
from serving.process_config import EngineProcessConfig

if TYPE_CHECKING:
    from serving.engine.core import EngineCore

log = logging.getLogger("hicache.engine")
STALL_WAIT_S = 0.002
STORAGE_POLL_S = 0.01  # while idle with L3 writes or fetches in flight

__all__ = ["SESSION_SWEEP_S", "STALL_WAIT_S", "EngineLoop"]


class EngineLoop:
    """The engine process's step loop (see the module docstring).

    Concurrency contract: everything here runs on the loop thread (the process's main thread,
    also the scheduler thread: it owns the EngineCore, the request table, the KV control and the
    cache events, and calls the dispatch and the housekeeping) but the receiver of ``inbox`` (see
    EngineInbox for that contract): the loop only ever takes messages from the inbox's queue,
    and sends its frames through ``inbox.send``. No lock; ``running`` may also be cleared by the
    process's SIGTERM handler (on this thread, between bytecodes). It waits for messages only
    while idle (at most ``SESSION_SWEEP_S``, ``STORAGE_POLL_S`` while L3 writes or fetches are in
    flight -- it settles them between waits -- or ``STALL_WAIT_S`` when work makes no progress),
    for one forward pass per turn, and for a test's ``hold``; an L3 lookup of the KV control is
    not waited for (answered by a later turn)."""

    def __init__(
        self, core: EngineCore, rx: Connection, tx: Connection, settings: EngineProcessConfig,
        heartbeat: m.Heartbeat | None = None,
    ) -> None:
        self.core = core
        self.inbox = EngineInbox(rx, tx)
        self.hold = StepHold()  # tests only (unset: nothing)
        self.outbox = Outbox(self.inbox)
        self.running = True
        self.broken: str | None = None  # why the cache's invariants broke (then the process exits)
        self.events: CacheEventLog | None = None
        if settings.enable_cache_events:
            self.events = CacheEventLog(core.tree, core.kv_namespace, core.config.cache.page_size)
        limits = ControlLimits(settings.max_sessions, settings.max_sessions_per_tenant, settings.max_pin_leases,
                               settings.max_pin_leases_per_tenant, settings.max_pin_ttl_s,
                               settings.max_pinned_l2_fraction)
        self.control = KVControl(core, limits)  # the KV control API: lookups, pin leases, session retention
        if settings.api_keys_file:  # the HTTP process validated it at start-up
            core.set_quotas(load_tenants(settings.api_keys_file).quotas())
        self.requests = RequestTable(core, self.control, self.outbox)
        self.housekeeping = Housekeeping(core, self.control, self.requests, self.outbox,
                                         settings.session_idle_timeout_s, heartbeat)
        self.dispatch = Dispatch(core, self.control, self.requests, self.housekeeping, self.events, self.outbox)
        # stamped before Ready is sent: loading the model took its time, the loop has not frozen
        self.housekeeping.beat(busy=False, progressed=True)

    @property
    def live(self) -> dict[str, Any]:
        """The live requests by rid (the request table's)."""
        return self.requests.live

    @property
    def out(self) -> list[m.Message]:
        """The replies queued this turn, not sent yet (the outbox's)."""
        return self.outbox.messages

    # -- loop ------------------------------------------------------------------------------
    def run(self) -> None:
        self.inbox.start()
        stalled = False
        while self.running:
            # Wait for messages when idle (at most SESSION_SWEEP_S: an idle loop still beats about
            # once a second, which the HTTP side's watchdog relies on); when the last step made no
            # progress (work waiting for pages, say), wait a moment instead of spinning.
            timeout = (STALL_WAIT_S if stalled else 0.0) if self.core.scheduler.has_work else SESSION_SWEEP_S
            timeout = min(timeout, STALL_WAIT_S) if self.control.busy else timeout
            storage_busy = self.core.storage_busy  # L3 writes / fetches settle on this thread
            timeout = min(timeout, STORAGE_POLL_S) if storage_busy else timeout
            try:
                msgs = self.inbox.get(timeout)
            except EOFError:
                log.info("HTTP process went away; engine exits")
                return
            for msg in msgs:
                if not self.running:
                    break
                self.handle(msg)
            stalled = False
            passes, finished = self.core.scheduler.stats.forward_passes, self.requests.finished
            if self.running and self.core.scheduler.has_work:
                self._step()
                stalled = self.core.scheduler.stats.forward_passes == passes
            elif storage_busy:  # idle: finished L3 writes release their L2 pins now, not at the next step
                self.core.poll_storage()
            self._collect()
            self.housekeeping.sweep_sessions()
            self.housekeeping.control_turn()
            self.flush()
            progressed = self.core.scheduler.stats.forward_passes != passes or self.requests.finished != finished
            self.housekeeping.beat(self.core.scheduler.has_work, progressed)

    def handle(self, msg: m.Message) -> None:
        if not self.dispatch.handle(msg):
            self.running = False

    def _collect(self) -> None:
        self.requests.collect()

    def flush(self) -> None:
        if not self.outbox.flush():
            self.running = False

    def stats(self) -> dict[str, Any]:
        return self.housekeeping.stats()

    def _step(self) -> None:
        self.hold.wait()
        try:
            self.core.step()
        except Exception:  # an engine bug: fail this step's requests, then check the cache
            text = traceback.format_exc()
            log.error("step failed:\n%s", text)
            self._fail_step(text.strip().splitlines()[-1])

    def _fail_step(self, error: str) -> None:
        """After a failed step: fail the requests that took part in it (a 500 each), give
        their pages back, and verify the cache's invariants. Requests still waiting with
        nothing allocated keep their place. If the invariants cannot be restored, tell every
        live request, then raise SystemExit(EXIT_BROKEN): the engine never serves on a broken
        tree (the HTTP process sees it gone and answers 503)."""
        failed, problems = self.requests.fail_step(error)
        try:
            self.core.check_integrity()
        except Exception as e:
            problems.append(f"check_integrity: {type(e).__name__}: {e}")
        if not problems:
            log.warning("step failed: %d request(s) failed, cache invariants hold; serving goes on", failed)
            return
        self.broken = "; ".join(problems)
        log.critical("after a failed step the cache invariants cannot be restored (%s); the engine exits "
                     "with status %d rather than serve on a broken tree", self.broken, m.EXIT_BROKEN)
        self.requests.fail_all(503, "the engine stopped: its cache is inconsistent after a failed step")
        self.running = False
        self.flush()
        raise SystemExit(m.EXIT_BROKEN)
