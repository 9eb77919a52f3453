"""The engine process's request table: rids <-> live requests, their outputs streamed back.

:class:`Outbox` holds the replies of one loop turn and sends them in one frame.
:class:`RequestTable` admits a ``GenerateReq`` (a request object in the scheduler's queue),
queues a ``TokenOut`` for every live request with news, forgets a request once it finished or
was aborted (its tenant's ledger, its session going idle), and after a failed step fails the
requests that took part in it. Rids and session ids arrive scoped by their tenant (the HTTP
process's doing, serving/scoped_ids.py); a message names the client's id. The loop that drives
both: serving.engine.loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serving import ipc as m
from serving.cache.kv_control import KVControl
from serving.engine.inbox import EngineInbox
from serving.runner.logprobs import LogprobState
from serving.scoped_ids import unscoped
from serving.structs.request import Req
from serving.structs.sampling_params import InvalidRequest

if TYPE_CHECKING:
    from serving.engine.core import EngineCore

log = logging.getLogger("hicache.engine")


class Outbox:
    """The replies queued during one loop turn (``TokenOut``, ``Result``, ``Error``), sent as one frame.

    Concurrency contract: used by the loop thread only (the request table, the dispatch and the
    housekeeping queue into it; the loop flushes it); no lock. ``flush`` sends through
    ``EngineInbox.send`` (which takes the inbox's send lock, shared with the receiver's
    acknowledgements) and waits only for that pipe write."""

    def __init__(self, inbox: EngineInbox) -> None:
        self.inbox = inbox
        self.messages: list[m.Message] = []

    def put(self, msg: m.Message) -> None:
        self.messages.append(msg)

    def flush(self) -> bool:
        """Send what is queued; False when the HTTP process's pipe is gone."""
        if not self.messages:
            return True
        frame = m.encode(self.messages)
        self.messages.clear()
        try:
            self.inbox.send(frame)
        except (BrokenPipeError, OSError):
            return False
        return True


@dataclass
class _Live:
    req: Req
    sent: int = -1  # output ids already sent; -1: not even the acceptance TokenOut


class RequestTable:
    """The live requests by rid, and what has been streamed back of each.

    Concurrency contract: the loop thread only (the engine process's main thread, which also owns
    the EngineCore and its scheduler); no lock. It never waits: admission adds to the scheduler's
    queue, a request whose grammar still compiles is skipped by ``collect`` until it is ready,
    and an abort is done at once. ``finished`` counts requests finished or aborted (the
    watchdog's progress)."""

    def __init__(self, core: EngineCore, control: KVControl, out: Outbox) -> None:
        self.core = core
        self.control = control
        self.out = out
        self.live: dict[str, _Live] = {}
        self.finished = 0

    def __contains__(self, rid: str) -> bool:
        return rid in self.live

    def busy_sessions(self) -> set[str | None]:
        return {live.req.session_id for live in self.live.values()}

    def generate(self, msg: m.GenerateReq) -> None:
        """Admit a request (into the scheduler's waiting queue), or answer it with an error."""
        if msg.rid in self.live:  # the HTTP side refuses it first; a rid is scoped by its tenant there
            self.out.put(m.Error(400, f"a request with rid {unscoped(msg.rid)!r} is already running", rid=msg.rid))
            return
        try:
            if msg.session_id is not None:
                self.control.retention.check_session(msg.session_id, msg.tenant)
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
                req.pd = msg.bootstrap
            if msg.capture_at:
                req.capture_at = tuple(int(p) for p in msg.capture_at)
            self.core.add(req)
        except InvalidRequest as e:
            self.out.put(m.Error(400, str(e), rid=msg.rid))
            return
        except KeyError as e:
            self.out.put(m.Error(404, str(e.args[0]) if e.args else "not found", rid=msg.rid))
            return
        except OverflowError as e:
            self.out.put(m.Error(429, str(e), rid=msg.rid))
            return
        except Exception as e:
            log.exception("could not add request %s", msg.rid)
            self.out.put(m.Error(500, f"could not add the request: {e}", rid=msg.rid))
            return
        self.live[msg.rid] = _Live(req)
        if req.session_id is not None:
            self.control.retention.session_active(req.session_id)

    def abort(self, rid: str) -> None:
        """The HTTP side stopped listening: abort the request; nothing is sent."""
        if rid in self.live:
            self.core.scheduler.abort(rid)
            self.forget(rid)

    def collect(self) -> None:
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
                self.out.put(m.Error(int(reason["status"]), str(reason.get("message", "")), rid=rid))
                self.forget(rid)
                continue
            if n == live.sent and not r.finished:
                continue
            start = max(live.sent, 0)
            self.out.put(
                m.TokenOut(
                    rid=rid,
                    offset=start,
                    new_ids=list(r.output_ids[start:n]),
                    prompt_tokens=len(r.input_ids),
                    cached_tokens=r.kv.cached_tokens,
                    cached_by_tier=dict(r.kv.cached_by_tier),
                    l3_decision=r.kv.l3_decision,
                    finish_reason=r.finish_reason,
                    logprobs=r.logprob.take_new(r.output_ids) if r.logprob is not None else None,
                    spec=r.spec.meta() if r.spec is not None else None,
                )
            )
            live.sent = n
            if r.finished:
                self.forget(rid)

    def forget(self, rid: str) -> None:
        live = self.live.pop(rid, None)
        if live is not None:
            self.finished += 1
            if live.req.kv.admitted:
                self.core.ledger.record(live.req.tenant, len(live.req.input_ids), live.req.kv.cached_by_tier)
        if live is not None and live.req.session_id is not None:
            sid = live.req.session_id
            if sid in self.core.sessions and not any(lv.req.session_id == sid for lv in self.live.values()):
                self.control.retention.session_idle(sid)

    def fail_step(self, error: str) -> tuple[int, list[str]]:
        """After a failed step: abort the requests that took part in it (their pages go back) and
        answer each live one with a 500. Requests still waiting with nothing allocated keep their
        place. Returns how many were failed, and what went wrong aborting them."""
        sched = self.core.scheduler
        queued = {id(r) for r in sched.waiting} | {id(r) for r in sched.running}
        affected = list(sched.running) + [
            r for r in sched.waiting if r.kv.pages or r.kv.lock_node is not None or r.kv.prefetch is not None
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
                self.out.put(m.Error(500, f"engine step failed: {error}", rid=r.rid))
                self.forget(r.rid)
        return len(affected), problems

    def fail_all(self, status: int, message: str) -> None:
        """Answer every live request with ``status`` and forget it (the engine is stopping)."""
        for rid in list(self.live):
            self.out.put(m.Error(status, message, rid=rid))
            self.forget(rid)
