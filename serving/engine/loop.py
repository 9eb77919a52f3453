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
"""

from __future__ import annotations

import logging
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from hicache.tenants import load_tenants
from serving import ipc as m
from serving.cache.kv_control import ControlError, ControlLimits, KVControl
from serving.disagg.protocol import Bootstrap
from serving.engine.cache_events import CacheEventLog
from serving.engine.config import EngineProcessConfig
from serving.engine.debug_hooks import StepHold
from serving.engine.heartbeat import HeartbeatWriter
from serving.engine.inbox import EngineInbox
from serving.model.logprobs import LogprobState
from serving.scheduler.request import Req
from serving.scheduler.sampling_params import InvalidRequest

log = logging.getLogger("hicache.engine")
SESSION_SWEEP_S = 1.0
STALL_WAIT_S = 0.002


@dataclass
class _Live:
    req: Req
    sent: int = -1  # output ids already sent; -1: not even the acceptance TokenOut


class EngineLoop:
    """The engine process's step loop (see the module docstring).

    Concurrency contract: everything here runs on the loop thread (the process's main thread,
    also the scheduler thread: it owns the EngineCore, ``live``, the KV control and the cache
    events) but the receiver of ``inbox`` (see EngineInbox for that contract): the loop only
    ever takes messages from the inbox's queue, and sends its frames through ``inbox.send``.
    No lock. It waits for messages only while idle (at most ``SESSION_SWEEP_S``, or
    ``STALL_WAIT_S`` when work makes no progress), for one forward pass per turn, and for a
    test's ``hold``; an L3 lookup of the KV control is not waited for (answered by a later
    turn)."""

    def __init__(
        self, core: Any, rx: Connection, tx: Connection, settings: EngineProcessConfig, heartbeat: Any = None
    ) -> None:
        self.core = core
        self.heartbeat = HeartbeatWriter(heartbeat)
        self.finished = 0  # requests finished or aborted (progress for the watchdog)
        self.inbox = EngineInbox(rx, tx)
        self.hold = StepHold()  # tests only (unset: nothing)
        self.idle_timeout = settings.session_idle_timeout_s
        self.live: dict[str, _Live] = {}
        self.out: list[m.Message] = []
        self.running = True
        self.broken: str | None = None  # why the cache's invariants broke (then the process exits)
        self._next_sweep = time.monotonic() + SESSION_SWEEP_S
        self.events: CacheEventLog | None = None
        if settings.enable_cache_events:
            self.events = CacheEventLog(core.tree, core.kv_namespace, core.config.cache.page_size)
        limits = ControlLimits(settings.max_sessions, settings.max_sessions_per_tenant, settings.max_pin_leases,
                               settings.max_pin_leases_per_tenant)
        self.control = KVControl(core, limits)  # the KV control API: lookups, pin leases, session retention
        if settings.api_keys_file:  # the HTTP process validated it at start-up
            core.set_quotas(load_tenants(settings.api_keys_file).quotas())
        # stamped before Ready is sent: loading the model took its time, the loop has not frozen
        self.heartbeat.beat(busy=False, progressed=True, forward_passes=core.scheduler.stats.forward_passes)

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
            passes, finished = self.core.scheduler.stats.forward_passes, self.finished
            if self.running and self.core.scheduler.has_work:
                self._step()
                stalled = self.core.scheduler.stats.forward_passes == passes
            self._collect()
            self._sweep_sessions()
            self._control_turn()
            self.flush()
            forward_passes = self.core.scheduler.stats.forward_passes
            self.heartbeat.beat(self.core.scheduler.has_work,
                                forward_passes != passes or self.finished != finished, forward_passes)

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
        sched = self.core.scheduler
        queued = {id(r) for r in sched.waiting} | {id(r) for r in sched.running}
        affected = list(sched.running) + [
            r for r in sched.waiting if r.pages or r.lock_node is not None or r.prefetch is not None
        ]
        # taken out of the queues mid-step and never finished: nobody would ever answer them
        affected += [lv.req for lv in self.live.values() if id(lv.req) not in queued and not lv.req.finished]
        problems: list[str] = []
        for r in affected:
            try:
                sched.abort(r.rid)  # returns its pages (full computed ones go into the tree)
            except Exception as e:
                log.exception("could not abort request %s after the failed step", r.rid)
                problems.append(f"abort of {r.rid} raised {type(e).__name__}: {e}")
            if r.rid in self.live:
                self.out.append(m.Error(500, f"engine step failed: {error}", rid=r.rid))
                self._forget(r.rid)
        try:
            self.core.check_integrity()
        except Exception as e:
            problems.append(f"check_integrity: {type(e).__name__}: {e}")
        if not problems:
            log.warning("step failed: %d request(s) failed, cache invariants hold; serving goes on", len(affected))
            return
        self.broken = "; ".join(problems)
        log.critical("after a failed step the cache invariants cannot be restored (%s); the engine exits "
                     "with status %d rather than serve on a broken tree", self.broken, m.EXIT_BROKEN)
        for rid in list(self.live):
            self.out.append(m.Error(503, "the engine stopped: its cache is inconsistent after a failed step",
                                    rid=rid))
            self._forget(rid)
        self.running = False
        self.flush()
        raise SystemExit(m.EXIT_BROKEN)

    def _collect(self) -> None:
        """Queue a TokenOut for every live request with news (new ids, finish, acceptance).

        A request with a grammar is accepted only once its grammar compiled: one that fails to
        (invalid, over the compile time budget) is answered with an error instead (a 400 naming
        the problem, before any stream starts), like a request refused at once. The engine never
        waits for it meanwhile: the request waits in the scheduler's queue."""
        for rid, live in list(self.live.items()):
            r = live.req
            n = len(r.output_ids)
            if live.sent < 0 and not r.finished and r.grammar is not None and not r.grammar.ready:
                continue  # still compiling
            reason = r.finish_reason or {}
            if reason.get("status") is not None and n == 0:  # refused after it was queued (its grammar failed)
                self.out.append(m.Error(int(reason["status"]), str(reason.get("message", "")), rid=rid))
                self._forget(rid)
                continue
            if n == live.sent and not r.finished:
                continue
            start = max(live.sent, 0)
            self.out.append(
                m.TokenOut(
                    rid=rid,
                    offset=start,
                    new_ids=list(r.output_ids[start:n]),
                    prompt_tokens=len(r.input_ids),
                    cached_tokens=r.cached_tokens,
                    cached_by_tier=dict(r.cached_by_tier),
                    l3_decision=r.l3_decision,
                    finish_reason=r.finish_reason,
                    logprobs=r.logprob.take_new(r.output_ids) if r.logprob is not None else None,
                    spec=r.spec.meta() if r.spec is not None else None,
                )
            )
            live.sent = n
            if r.finished:
                self._forget(rid)

    def flush(self) -> None:
        if self.out:
            frame, self.out = m.encode(self.out), []
            try:
                self.inbox.send(frame)
            except (BrokenPipeError, OSError):
                self.running = False

    def _forget(self, rid: str) -> None:
        live = self.live.pop(rid, None)
        if live is not None:
            self.finished += 1
            if live.req.admitted:
                self.core.ledger.record(live.req.tenant, len(live.req.input_ids), live.req.cached_by_tier)
        if live is not None and live.req.session_id is not None:
            sid = live.req.session_id
            if sid in self.core.sessions and not any(lv.req.session_id == sid for lv in self.live.values()):
                self.control.session_idle(sid)

    # -- messages --------------------------------------------------------------------------
    def handle(self, msg: m.Message) -> None:
        if isinstance(msg, m.GenerateReq):
            self._generate(msg)
        elif isinstance(msg, m.AbortReq):
            if msg.rid in self.live:
                self.core.scheduler.abort(msg.rid)
                self._forget(msg.rid)  # the HTTP side stopped listening: nothing to send
        elif isinstance(msg, m.Shutdown):
            self.running = False
        else:
            self._call(msg)

    def _generate(self, msg: m.GenerateReq) -> None:
        if msg.rid in self.live:
            self.out.append(m.Error(400, f"a request with rid {msg.rid!r} is already running", rid=msg.rid))
            return
        try:
            if msg.session_id is not None:
                self.control.check_session(msg.session_id, msg.tenant)
            req = self.core.make_request(
                input_ids=msg.input_ids,
                sampling_params=msg.sampling_params,
                session_id=msg.session_id,
                rid=msg.rid,
                cache_salt=msg.cache_salt,
                tenant=msg.tenant,
            )
            req.logprob = LogprobState.from_request(msg.logprobs, req.input_ids, self.core.runner.arch.vocab_size)
            if msg.bootstrap is not None:
                req.pd = Bootstrap(**msg.bootstrap)
            self.core.add(req)
        except InvalidRequest as e:
            self.out.append(m.Error(400, str(e), rid=msg.rid))
            return
        except KeyError as e:
            self.out.append(m.Error(404, str(e.args[0]) if e.args else "not found", rid=msg.rid))
            return
        except OverflowError as e:
            self.out.append(m.Error(429, str(e), rid=msg.rid))
            return
        except Exception as e:
            log.exception("could not add request %s", msg.rid)
            self.out.append(m.Error(500, f"could not add the request: {e}", rid=msg.rid))
            return
        self.live[msg.rid] = _Live(req)
        if req.session_id is not None:
            self.control.session_active(req.session_id)

    def _call(self, msg: m.Message) -> None:
        call_id = msg.call_id  # type: ignore[union-attr]
        deadline = getattr(msg, "deadline", 0.0)
        if deadline and time.monotonic() > deadline:  # its caller answered 504 already: not done
            log.warning("%s not run: its caller stopped waiting %.1f s ago (engine_call_timeout_s)",
                        type(msg).__name__, time.monotonic() - deadline)
            return
        try:
            value = self._call_value(msg)
        except KeyError as e:
            self.out.append(m.Error(404, str(e.args[0]) if e.args else "not found", call_id=call_id))
        except ControlError as e:
            self.out.append(m.Error(e.status, str(e), call_id=call_id))
        except Exception as e:
            log.exception("call %s failed", type(msg).__name__)
            self.out.append(m.Error(500, f"{type(msg).__name__} failed: {e}", call_id=call_id))
        else:
            if isinstance(value, Future):  # answered by _control_turn once it is done
                self.control.defer(call_id, value)
            else:
                self.out.append(m.Result(call_id, value))

    def _call_value(self, msg: m.Message) -> Any:
        core = self.core
        if isinstance(msg, m.OpenSession):  # 409 for an open id, 429 at a cap (serving/cache/kv_sessions.py)
            return core.open_session(self.control.open_session(msg.session_id, msg.tenant, msg.retention))
        if isinstance(msg, m.CloseSession):
            self.control.check_session(msg.session_id, msg.tenant)
            core.close_session(msg.session_id)
            self.control.close_session(msg.session_id)
            return True
        if isinstance(msg, m.FlushCache):
            flushed = core.flush_cache()
            if flushed:
                self.control.release_all()  # their pages left the tree
            return flushed
        if isinstance(msg, m.KVControlCall):
            return self.control.call(msg.op, msg.args, msg.tenant)
        if isinstance(msg, m.CheckIntegrity):
            try:
                core.check_integrity()
                self.control.check_integrity()
            except AssertionError as e:
                return {"ok": False, "error": str(e) or traceback.format_exc(), **self.stats()}
            return {"ok": True, **self.stats()}
        if isinstance(msg, m.Stats):
            return self.stats()
        if isinstance(msg, m.CacheEvents):
            if self.events is None:
                raise KeyError("cache events are off (start the server with --enable-cache-events)")
            return self.events.read(msg.since, msg.epoch)
        raise TypeError(f"unexpected message {type(msg).__name__}")

    def stats(self) -> dict[str, Any]:
        s = self.core.scheduler.stats
        pages = {"device": _pages(self.core.runner.pool.allocator)}
        host = getattr(self.core, "host_pool", None)
        if host is not None:
            pages["host"] = _pages(host.allocator)
        return {
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "cached_by_tier": dict(s.cached_by_tier),
            "generated_tokens": s.generated_tokens,
            "retractions": s.retractions,
            "forward_passes": s.forward_passes,
            "running": len(self.core.scheduler.running),
            "waiting": len(self.core.scheduler.waiting),
            "sessions": len(self.core.sessions),
            "pages": pages,
            "storage": self.core.storage_stats(),
            "tenants": self.control.tenant_snapshot(),  # + pinned pages (cache_control, pins)
            "bytes_per_page": self._bytes_per_page(),
            **({"pd": self.core.scheduler.pd.stats()} if self.core.scheduler.pd is not None else {}),
            **({"speculative": self.core.scheduler.spec.stats_dict()} if self.core.scheduler.spec is not None else {}),
        }

    def _bytes_per_page(self) -> dict[str, int]:
        pool = self.core.runner.pool
        out = {"device": int(pool.bytes_per_page)}
        if getattr(self.core, "host_pool", None) is not None:
            out["host"] = int(self.core.host_pool.bytes_per_page)  # its encoding's
        if getattr(self.core, "storage", None) is not None:
            out["storage"] = int(self.core.storage.tier.codec.value_nbytes)
        return out

    # -- sessions --------------------------------------------------------------------------
    def _sweep_sessions(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SESSION_SWEEP_S
        busy = {live.req.session_id for live in self.live.values()}
        for sid, idle_s in self.control.idle_sessions(busy, self.idle_timeout):  # serving/cache/kv_sessions.py
            if sid in self.core.sessions:
                log.info("session %s idle for %.0f s: closed", sid, idle_s)
                self.core.close_session(sid)
            self.control.close_session(sid)

    def _control_turn(self) -> None:
        """Leases that ended are released; deferred control answers (L3 lookups) are sent."""
        if self.control.leases:
            self.control.expire()
        for call_id, value, err in self.control.poll():
            self.out.append(m.Error(500, f"lookup failed: {err}", call_id=call_id) if err is not None
                            else m.Result(call_id, value))


def _pages(alloc: Any) -> dict[str, int]:
    return {"total": alloc.num_pages, "used": alloc.num_used}
