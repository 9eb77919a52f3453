"""The decode server's role: take pages for the prompt, have the prefill server fill them, decode.

A request with bootstrap fields waits here, not in the scheduler's queue (one without them,
such as the warm-up, is served colocated):

1. **pending**: when L1 has room, it takes pages for its prompt: with
   ``--disaggregation-decode-enable-radix-cache`` first the prefix its tree holds (matched
   and locked like any admission, so only the rest travels), then fresh pages for the rest
   (with a hybrid SWA L1, window pages only for those in the prompt's last window: the sender
   fills them with its sliding layers' KV there);
2. **registered**: an I/O thread PUTs the :class:`~serving.disagg.protocol.DecodeTarget`
   to the prefill server's bootstrap port; the request waits for its room's
   :class:`~serving.disagg.protocol.KVDone` on this role's control server;
3. on success it joins the scheduler's running batch at ``kv_len == len(prompt)`` with the
   first token (returned by ``step``: ``Scheduler.start_decoding``) and the prefill side's logprobs of that token and
   of the prompt, when it asks (serving/disagg/logprob_handoff.py); on failure or timeout it finishes with the
   error's status and its fresh pages go to **quarantine** for ``2 x timeout`` before they
   are freed, so that a transfer that arrives late can never write into reused pages.

Concurrency contract: see :mod:`serving.disagg.role_base`. The registration thread gets a copy
of the target and reports failures through the control server's inbox.
"""

from __future__ import annotations

import logging
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from serving.disagg import logprob_handoff
from serving.disagg.control import ControlServer, post_json
from serving.disagg.protocol import DecodeTarget, KVDone, prompt_digest
from serving.disagg.role_base import PDRole, RoleContext
from serving.process_config import EngineProcessConfig
from serving.structs.request import Req
from serving.structs.sampling_params import InvalidRequest

log = logging.getLogger("hicache.pd")
REGISTER_TIMEOUT_S = 10.0
PROBE_EVERY_S = 1.0  # how often the prefill servers of waiting rooms are checked for life


@dataclass(frozen=True)
class PrefillGone:
    """Inbox message from a probe: the prefill server at ``url`` does not answer."""

    url: str
    error: str


class DecodeRole(PDRole):
    mode = "decode"

    def __init__(self, server: EngineProcessConfig, ctx: RoleContext) -> None:
        self._open_transport(server, ctx)
        self.use_radix = server.disaggregation_decode_enable_radix_cache
        self.control = ControlServer(server.host, 0, {"mode": self.mode})
        self.io = ThreadPoolExecutor(2, thread_name_prefix="hicache-pd-register")
        self.pending: list[Req] = []
        self.registered: dict[int, tuple[Req, float]] = {}  # room -> (request holding its pages, since)
        self.quarantine: list[tuple[Req, float]] = []  # (failed request still holding pages, free after)
        self._probing: set[str] = set()  # prefill bootstrap URLs with a probe in flight
        self._next_probe = 0.0
        self.counters = {"received": 0, "failed": 0, "pages_received": 0, "pages_reused": 0, "bytes_received": 0}

    # -- hooks ----------------------------------------------------------------------------
    def on_add(self, req: Req) -> bool:
        if req.pd is None:
            return False  # a plain request (the warm-up, a direct call) is served here, colocated
        if req.pd.room in self.registered or any(r.pd.room == req.pd.room for r in self.pending):
            raise InvalidRequest(f"bootstrap_room {req.pd.room} is already in use on this server")
        self.pending.append(req)
        return True

    def on_finish(self, req: Req) -> bool:
        """With L2/L3, a finished PD request's whole sequence (prompt and answer) is backed up
        now, so the next turn's prefill server finds the answer's KV in the shared L3."""
        if req.pd is None or self.cache.storage is None:
            return False
        self.cache.release_and_back_up(req)
        return True

    def step(self) -> list[tuple[Req, int]]:
        """Arrivals, failures, probes, registrations, timeouts, quarantine; returns the requests whose
        prompt KV arrived this step, each with its first token (the scheduler starts decoding them)."""
        now = time.monotonic()
        arrived = []
        for msg in self.control.drain():
            if isinstance(msg, KVDone):
                got = self._arrived(msg)
                if got is not None:
                    arrived.append(got)
            elif isinstance(msg, PrefillGone):
                self._probing.discard(msg.url)
                if not msg.error:
                    continue
                for room in [k for k, (r, _) in self.registered.items() if r.pd.url == msg.url]:
                    self._fail(room, 502, f"the prefill server went away: {msg.error}")
        if now >= self._next_probe:
            self._next_probe = now + PROBE_EVERY_S
            for url in {r.pd.url for r, since in self.registered.values() if now - since > PROBE_EVERY_S}:
                if url not in self._probing:
                    self._probing.add(url)
                    self.io.submit(self._probe, url)
        while self.pending and self._take_pages(self.pending[0]):
            req = self.pending.pop(0)
            self.registered[req.pd.room] = (req, now)
            self.io.submit(self._register, req.pd.url, self._target(req))
        for room, (_req, since) in list(self.registered.items()):
            if now - since > self.timeout_s:
                self._fail(room, 504, f"the KV of this request did not arrive within {self.timeout_s:.0f} s "
                                      "(disaggregation_bootstrap_timeout_s)")
        keep = []
        for req, until in self.quarantine:
            if now >= until:
                self.cache.release(req)
            else:
                keep.append((req, until))
        self.quarantine = keep
        return arrived

    def abort(self, rid: str) -> Req | None:
        for req in self.pending:
            if req.rid == rid:
                self.pending.remove(req)
                req.finish_reason = {"type": "abort", "message": "aborted"}
                return req
        for room, (req, _) in self.registered.items():
            if req.rid == rid:
                self._fail(room, 499, "aborted")
                return req
        return None

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.registered or self.quarantine) or not self.control.inbox.empty()

    def held_pages(self) -> int:
        return sum(r.own_pages for r, _ in self.registered.values()) + sum(r.own_pages for r, _ in self.quarantine)

    def stats(self) -> dict[str, Any]:
        return {"disaggregation_mode": self.mode, "pending": len(self.pending), "registered": len(self.registered),
                "quarantined": len(self.quarantine), **self.counters}

    def close(self) -> None:
        self.io.shutdown(wait=True)
        for room in list(self.registered):
            self._fail(room, 503, "the server is shutting down")
        for req, _ in self.quarantine:
            self.cache.release(req)
        self.quarantine.clear()
        self.control.close()
        self.transport.close()

    # -- internals ------------------------------------------------------------------------
    def _take_pages(self, req: Req) -> bool:
        """Pages for the whole prompt: the cached prefix (radix cache on) plus fresh ones."""
        return self.cache.take_prompt(req, self.use_radix)  # no room yet: tried again next step

    def _target(self, req: Req) -> DecodeTarget:
        wins, since = self._window_target(req)
        return DecodeTarget(room=req.pd.room, prompt_len=len(req.input_ids), prompt_digest=prompt_digest(req.input_ids),
                            endpoint=self.transport.endpoint(), geometry=self.geometry,
                            pages=list(req.kv.pages[req.kv.tree_pages:]), skip_pages=req.kv.tree_pages,
                            notify_url=f"{self.control.url}/pd/done", state=self.state_geometry,
                            state_slot=req.kv.state_slot, window=self.window_geometry, window_pages=wins,
                            window_from=since)

    def _window_target(self, req: Req) -> tuple[list[int], int]:
        """A hybrid SWA L1: the window pages (taken by ``take_prompt``) of the request's own prompt pages in
        the prompt's last window -- what its next tokens read and where the same prompt resumes -- and the
        prompt page they start at; the sender fills them. Pages it reuses from its tree hold theirs already."""
        windows = self.cache.windows
        if windows is None:
            return [], 0
        since = max(windows.first_needed(windows.prompt_end(req)), req.kv.tree_pages)
        m = windows.windows.map
        return [m[p] for p in req.kv.pages[since: -(-len(req.input_ids) // self.page_size)]], since

    def _register(self, url: str, target: DecodeTarget) -> None:
        """I/O thread: hand the target to the prefill server; a failure comes back as a KVDone."""
        try:
            post_json(f"{url}/pd/target", target.to_dict(), REGISTER_TIMEOUT_S)
        except ConnectionError as e:
            self.control.inbox.put(KVDone(target.room, False, status=502,
                                          error=f"could not reach the prefill server's bootstrap: {e}"))

    def _probe(self, url: str) -> None:
        """I/O thread: is the prefill server's bootstrap still there?"""
        try:
            with urllib.request.urlopen(f"{url}/pd/info", timeout=REGISTER_TIMEOUT_S) as resp:  # noqa: S310
                resp.read()
            self.control.inbox.put(PrefillGone(url, ""))  # alive: only clears the in-flight mark
        except OSError as e:
            self.control.inbox.put(PrefillGone(url, f"{url} is unreachable: {e}"))

    def _arrived(self, done: KVDone) -> tuple[Req, int] | None:
        """The request whose KV ``done`` reports and its first token; None when it failed (finished here)
        or had gone (timed out or aborted meanwhile: its pages are in quarantine)."""
        entry = self.registered.get(done.room)
        if entry is None:
            return None
        req, _ = entry
        if not done.ok:
            self._fail(done.room, done.status or 502, done.error)
            return None
        why = logprob_handoff.adopt(req.logprob, done.logprobs, done.first_token)
        if why is not None:  # never answer logprobs this side did not get
            self._fail(done.room, 502, why)
            return None
        del self.registered[done.room]
        reused = req.kv.tree_pages
        self.cache.prompt_arrived(req, done.cached_tokens, done.cached_by_tier)  # the prefill side's hit
        self.counters["received"] += 1
        self.counters["pages_received"] += done.pages
        self.counters["pages_reused"] += reused
        self.counters["bytes_received"] += done.nbytes
        return req, done.first_token

    def _fail(self, room: int, status: int, message: str) -> None:
        req, _ = self.registered.pop(room)
        self.counters["failed"] += 1
        req.finish_reason = {"type": "abort", "status": status, "message": message}
        self.quarantine.append((req, time.monotonic() + 2 * self.timeout_s))
