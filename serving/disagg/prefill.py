"""The prefill server's role: compute the prompt, send its KV to the decode server, let go.

A request with bootstrap fields runs through the normal scheduler (and the whole HiCache:
L1/L2/L3 hits count) with ``max_new_tokens`` forced to 1. When it finishes (its first
token sampled), :meth:`PrefillRole.on_finish` *parks* it: its L1 pages stay held (locked
prefix + own pages) while the KV travels. It is sent once its room's
:class:`~serving.disagg.protocol.DecodeTarget` has arrived on the bootstrap port (before or
after the prompt is done); the sender thread writes the pages the decode side lacks in one
batched transport call (with a hybrid SWA L1, also the sliding layers' KV of the prompt's last
window, from its window pages into the decode side's) and POSTs the :class:`~serving.disagg.protocol.KVDone` (with the
first token's and the prompt's logprobs when the request asks: serving/disagg/logprob_handoff.py;
a 400 to the decode side when they are more than the control channel carries). Only then are
the pages released into the tree (:meth:`step` polls the send futures).

Concurrency contract: see :mod:`serving.disagg.role_base`. ``parked`` / ``targets`` / ``sending``
are scheduler-thread state. The sender thread reads a parked request's ``pages``,
``input_ids`` and ``output_ids``, which nobody changes while it is parked; a hybrid SWA L1's window
pages of its last window are read from the window map on the scheduler thread and handed to it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from serving.disagg import logprob_handoff
from serving.disagg.control import MAX_BODY, ControlServer, post_json
from serving.disagg.protocol import DecodeTarget, KVDone, prompt_digest
from serving.disagg.role_base import PDRole, RoleContext
from serving.process_config import EngineProcessConfig
from serving.structs.request import Req

log = logging.getLogger("hicache.pd")
NOTIFY_TIMEOUT_S = 10.0
MAX_WAITING_TARGETS = 4096


class PrefillRole(PDRole):
    mode = "prefill"

    def __init__(self, server: EngineProcessConfig, ctx: RoleContext) -> None:
        self._open_transport(server, ctx)
        info = {"mode": self.mode, "backend": server.disaggregation_transfer_backend}
        self.control = ControlServer(server.host, server.disaggregation_bootstrap_port, info)
        self.sender = ThreadPoolExecutor(1, thread_name_prefix="hicache-pd-send")
        self.parked: dict[int, tuple[Req, float]] = {}  # room -> (finished request holding its pages, since)
        self.targets: dict[int, tuple[DecodeTarget, float]] = {}  # room -> (decode side's pages, arrived)
        self.sending: dict[int, tuple[Req, Future]] = {}
        self.failed: dict[int, tuple[str, float]] = {}  # rooms whose prefill failed: told to the target
        self.counters = {"sent": 0, "send_failed": 0, "expired": 0, "pages_sent": 0, "bytes_sent": 0,
                         "transfer_s": 0.0}

    # -- hooks ----------------------------------------------------------------------------
    def on_add(self, req: Req) -> bool:
        if req.pd is not None and req.sampling.max_new_tokens != 1:
            req.sampling = dataclasses.replace(req.sampling, max_new_tokens=1)  # the decode side does the rest
        return False

    def on_finish(self, req: Req) -> bool:
        if req.pd is None:
            return False
        room = req.pd.room
        if not req.output_ids or room in self.parked or room in self.sending:
            reason = (req.finish_reason or {}).get("message", "the prefill did not complete")
            self.failed[room] = (f"prefill failed: {reason}", time.monotonic())
            return False
        self.parked[room] = (req, time.monotonic())
        return True

    def step(self) -> list[tuple[Req, int]]:
        """Targets in, parked requests out to their targets; nothing arrives here (returns [])."""
        now = time.monotonic()
        for t in self.control.drain():
            if not isinstance(t, DecodeTarget):
                continue
            if t.room in self.targets or t.room in self.sending:  # two decode requests, one room
                done = KVDone(t.room, False, error=f"bootstrap_room {t.room} is already in use", status=409)
                self.sender.submit(self._notify, t, done)
            elif len(self.targets) >= MAX_WAITING_TARGETS:  # rooms whose request never comes pile up: bounded
                done = KVDone(t.room, False, error=f"{MAX_WAITING_TARGETS} rooms are waiting for their request on "
                              "this prefill server", status=429)
                self.sender.submit(self._notify, t, done)
            else:
                self.targets[t.room] = (t, now)
        for room in [r for r in self.parked if r in self.targets]:
            req, _ = self.parked.pop(room)
            target, _ = self.targets.pop(room)
            lp = logprob_handoff.export(req.logprob)  # here: nothing touches the state while the KV travels
            wins = self._window_sources(req, target)  # (the window map is this thread's)
            self.sending[room] = (req, self.sender.submit(self._send, req, target, lp, wins))
        for room, (req, fut) in list(self.sending.items()):
            if fut.done():
                del self.sending[room]
                self.cache.release(req)
                self._count(fut)
        for room in [r for r in self.failed if r in self.targets]:
            target, _ = self.targets.pop(room)
            msg, _ = self.failed.pop(room)
            self.sender.submit(self._notify, target, KVDone(room, False, error=msg, status=500))
        self._expire(now)
        return []

    def abort(self, rid: str) -> Req | None:
        return None  # parked requests have finished; their send completes or fails on its own

    @property
    def busy(self) -> bool:
        return bool(self.parked or self.sending or self.targets or self.failed) or not self.control.inbox.empty()

    def held_pages(self) -> int:
        return sum(r.own_pages for r, _ in self.parked.values()) + sum(r.own_pages for r, _ in self.sending.values())

    def stats(self) -> dict[str, Any]:
        return {"disaggregation_mode": self.mode, "parked": len(self.parked), "sending": len(self.sending),
                "targets_waiting": len(self.targets), **self.counters}

    def close(self) -> None:
        self.sender.shutdown(wait=True)
        for room, (req, _) in list(self.sending.items()):
            self.cache.release(req)
            del self.sending[room]
        for req, _ in self.parked.values():
            self.cache.release(req)
        self.parked.clear()
        self.control.close()
        self.transport.close()

    # -- internals ------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        for room, (req, since) in list(self.parked.items()):
            if now - since > self.timeout_s:  # no decode server asked for it
                del self.parked[room]
                self.cache.release(req)
                self.counters["expired"] += 1
                log.warning("PD room %d: no decode server registered within %.0f s; KV dropped", room, self.timeout_s)
        for room, (target, since) in list(self.targets.items()):
            if now - since > self.timeout_s:  # its request never came (or failed before it parked)
                del self.targets[room]
                self.counters["expired"] += 1
                done = KVDone(room, False, error="the prefill server never received this request", status=504)
                self.sender.submit(self._notify, target, done)
        for room, (_, since) in list(self.failed.items()):
            if now - since > self.timeout_s:
                del self.failed[room]

    def _count(self, fut: Future) -> None:
        res = fut.result()
        if res is None:
            self.counters["send_failed"] += 1
            return
        self.counters["sent"] += 1
        self.counters["pages_sent"] += res.pages
        self.counters["bytes_sent"] += res.nbytes
        self.counters["transfer_s"] += res.transfer_s

    def _window_sources(self, req: Req, target: DecodeTarget) -> list[int] | None:
        """A hybrid SWA L1: the window pages holding the sliding layers' KV of the request's prompt pages
        ``target.window_from ..`` (-1 where a page has none: the send fails); None without a window pool."""
        windows = self.cache.windows
        if windows is None:
            return None
        need = -(-len(req.input_ids) // self.page_size)
        m = windows.windows.map
        return [m[p] for p in req.kv.pages[min(target.window_from, need):need]]

    def _send(self, req: Req, target: DecodeTarget, lp: dict[str, Any] | None,
              wins: list[int] | None = None) -> KVDone | None:
        """Sender thread: write the pages the decode side lacks, then report. None on failure."""
        if lp is not None and (size := len(json.dumps(lp))) > MAX_BODY - 64 * 1024:
            msg = (f"the prompt logprobs of this request take {size} bytes, over what the PD control channel "
                   f"carries ({MAX_BODY} bytes); ask for fewer (a later logprob_start_len, a smaller "
                   "top_logprobs_num or token_ids_logprob) or use a colocated server")
            self._notify(target, KVDone(target.room, False, error=msg, status=400))
            return None
        try:
            done = self._write(req, target, lp, wins)
        except Exception as e:  # noqa: BLE001 - any failure is reported to the decode side
            log.warning("PD room %d: sending KV failed: %s", target.room, e)
            self._notify(target, KVDone(target.room, False, error=f"KV transfer failed: {e}", status=502))
            return None
        return done if self._notify(target, done) else None

    def _write(self, req: Req, target: DecodeTarget, lp: dict[str, Any] | None,
               wins: list[int] | None = None) -> KVDone:
        n = len(req.input_ids)
        if target.prompt_len != n or target.prompt_digest != prompt_digest(req.input_ids):
            raise ValueError(f"the decode server tokenized the prompt differently ({target.prompt_len} tokens "
                             f"there, {n} here)")
        if (self.window_geometry is None) != (target.window is None):
            here, there = ("on", "off") if self.window_geometry is not None else ("off", "on")
            raise ValueError(f"the hybrid SWA L1 (--enable-hybrid-swa-memory) is {here} here and {there} on the "
                             "decode server: the sliding layers' KV is kept differently; start both the same way")
        why = self.geometry.mismatch(target.geometry)
        if why is not None:
            raise ValueError(f"KV layouts differ: {why}")
        need = -(-n // self.page_size)
        src_pages = req.kv.pages[target.skip_pages:need]
        if len(src_pages) != len(target.pages) or target.skip_pages > need:
            raise ValueError(f"the decode server offered {len(target.pages)} pages after {target.skip_pages}; "
                             f"the prompt needs {need - target.skip_pages}")
        src, dst = self.geometry.addrs(src_pages), target.geometry.addrs(target.pages)
        lengths = [self.geometry.chunk] * len(src)
        if self.state_geometry is not None or target.state is not None:  # the state after the prompt
            src, dst, lengths = self._with_state(req, target, list(src), list(dst), lengths)
        if target.window is not None:  # the sliding layers' KV of the prompt's last window
            src, dst, lengths = self._with_window(target, wins or [], list(src), list(dst), lengths)
        t0 = time.perf_counter()
        if len(src):  # the transport coalesces neighbouring chunks
            self.transport.write(target.endpoint, src, dst, lengths)
        dt = time.perf_counter() - t0
        return KVDone(target.room, True, first_token=req.output_ids[0], cached_tokens=req.kv.cached_tokens,
                      cached_by_tier=dict(req.kv.cached_by_tier), pages=len(src_pages),
                      nbytes=sum(lengths), transfer_s=dt, logprobs=lp)

    def _with_state(self, req: Req, target: DecodeTarget, src: list[int], dst: list[int],
                    lengths: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Add the rows of the request's working state slot (its state after the whole prompt) to the
        write, into the decode request's slot."""
        if self.state_geometry is None:
            raise ValueError("the decode server's model has recurrent-state layers, this one's has none")
        why = self.state_geometry.mismatch(target.state)
        if why is not None:
            raise ValueError(why)
        s_src, s_len = self.state_geometry.addrs(req.kv.state_slot)
        s_dst, _ = target.state.addrs(target.state_slot)
        return src + s_src, dst + s_dst, lengths + s_len

    def _with_window(self, target: DecodeTarget, wins: list[int], src: list[int], dst: list[int],
                     lengths: list[int]) -> tuple[list[int], list[int], list[int]]:
        """Add the window pages of the prompt's last window (``wins``: this side's, in prompt page order from
        ``target.window_from``) to the write, into the decode side's ``target.window_pages``."""
        why = self.window_geometry.mismatch(target.window)
        if why is not None:
            raise ValueError(f"window pools differ: {why}")
        if len(wins) != len(target.window_pages):
            raise ValueError(f"the decode server offered {len(target.window_pages)} window pages from prompt page "
                             f"{target.window_from}; the prompt has {len(wins)} from there")
        if any(w < 0 for w in wins):
            raise ValueError("the prefill server no longer holds the sliding layers' KV of the prompt's last window")
        w_src, w_dst = self.window_geometry.addrs(wins), target.window.addrs(target.window_pages)
        return src + list(w_src), dst + list(w_dst), lengths + [self.window_geometry.chunk] * len(w_src)

    def _notify(self, target: DecodeTarget, done: KVDone) -> bool:
        try:
            post_json(target.notify_url, done.to_dict(), NOTIFY_TIMEOUT_S)
            return True
        except ConnectionError as e:
            log.warning("PD room %d: could not report to the decode server: %s", target.room, e)
            return False
