"""Open sessions as the KV control API sees them: who owns each, its ``/open_session`` retention
hints, and the caps on how many may be open (serving/cache/kv_control_limits.py).

- Each tenant has its own namespace of session ids: the ids here are the engine's keys,
  ``session_key(tenant, id)`` (serving/scoped_ids.py; the HTTP process sends them so), so two
  tenants may open the same id independently, and every message names the client's id
  (``unscoped``), never another tenant's.
- Opening an id that is open is a 409 "already open" (as SGLang refuses it: "Check if a session
  with the same id is still open").
- Past ``max_sessions`` open sessions, or ``max_sessions_per_tenant`` of one keys-file tenant,
  opening is a 429 naming the cap; closing one (or its idle timeout) makes room.
- A session that is not open, or not the caller's, is "unknown session_id" (a KeyError: 404).

- When each was last used (opened, a request of it added or its last live request finished):
  the engine loop's sweep closes a session idle for longer than its ``ttl_s`` hint, or else
  ``--session-idle-timeout-s`` (:meth:`SessionRegistry.idle`; ``time.monotonic()``, not the
  lease clock).

Which ids are open in the engine is the tree's (``EngineCore.sessions`` is ``tree.sessions``,
what a request's ``session_id`` is checked against, and where a session's soft references
live); :meth:`SessionRegistry.check_integrity` checks both agree.

Concurrency contract: engine loop thread only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Container, Sized
from typing import Any, Protocol

from serving.cache.kv_control_limits import ControlError, ControlLimits
from serving.scoped_ids import unscoped


class OpenSessions(Container[str], Sized, Protocol):
    """What :meth:`SessionRegistry.check_integrity` needs of the engine's open sessions."""


class SessionRegistry:
    """Open sessions as the KV control API sees them: ``owner`` (session -> tenant),
    ``retention`` (its ``/open_session`` hints) and ``used`` (session -> when it was last used,
    ``time.monotonic()``), all of the same open ids.

    Concurrency contract: the engine loop thread only (it is a part of ``KVControl``); nothing
    here waits or takes a lock.
    """

    def __init__(self, limits: ControlLimits) -> None:
        self.limits = limits
        self.owner: dict[str, str | None] = {}  # open session -> its tenant (None: the default one)
        self.retention: dict[str, dict[str, Any]] = {}  # session -> its /open_session hints
        self.used: dict[str, float] = {}  # open session -> when it was last used (time.monotonic())
        self._per_tenant: Counter[str | None] = Counter()

    def __contains__(self, sid: str) -> bool:
        return sid in self.owner

    def __len__(self) -> int:
        return len(self.owner)

    def admit(self, sid: str, tenant: str | None) -> None:
        """Raise ControlError (409 / 429) unless ``tenant`` may open ``sid`` now."""
        if sid in self.owner:  # the caller's own: another tenant's ids are other keys (scoped_ids)
            raise ControlError(409, f"session_id {unscoped(sid)!r} is already open: close it first "
                                    "(/close_session), or open a session without session_id to get a fresh id")
        cap = self.limits.max_sessions
        if len(self.owner) >= cap:
            raise ControlError(429, f"{len(self.owner)} sessions are open, the most this server allows "
                                    f"(max_sessions {cap}): close some (/close_session) or let them idle out")
        cap = self.limits.max_sessions_per_tenant
        if tenant is not None and self._per_tenant[tenant] >= cap:
            raise ControlError(429, f"tenant {tenant!r} has {self._per_tenant[tenant]} open sessions, the most a "
                                    f"tenant may (max_sessions_per_tenant {cap}): close some (/close_session) "
                                    "or let them idle out")

    def open(self, sid: str, tenant: str | None, retention: dict[str, Any] | None) -> None:
        self.admit(sid, tenant)
        self.owner[sid] = tenant
        self._per_tenant[tenant] += 1
        self.used[sid] = time.monotonic()
        if retention:
            self.retention[sid] = dict(retention)

    def touch(self, sid: str) -> None:
        """``sid`` was used now (a request of it was added, or its last live request finished)."""
        if sid in self.owner:
            self.used[sid] = time.monotonic()

    def idle(self, busy: Container[str], default_ttl_s: float) -> list[tuple[str, float]]:
        """(session, seconds idle) of each open session not in ``busy`` that has been idle for at
        least its ``ttl_s`` hint, or else ``default_ttl_s``."""
        now = time.monotonic()
        return [(sid, now - used) for sid, used in list(self.used.items())
                if sid not in busy and now - used >= float(self.retention.get(sid, {}).get("ttl_s", default_ttl_s))]

    def check(self, sid: str, tenant: str | None) -> None:
        """KeyError (404) unless ``sid`` is an open session of ``tenant``'s (named as its client
        knows it)."""
        if sid not in self.owner or self.owner[sid] != tenant:
            raise KeyError(f"unknown session_id {unscoped(sid)!r}")

    def close(self, sid: str) -> None:
        if sid in self.owner:
            tenant = self.owner.pop(sid)
            self._per_tenant[tenant] -= 1
            if not self._per_tenant[tenant]:
                del self._per_tenant[tenant]
        self.retention.pop(sid, None)
        self.used.pop(sid, None)

    def check_integrity(self, open_ids: OpenSessions) -> None:
        """Raise AssertionError unless the registry holds exactly the engine's open sessions,
        each with a time of last use, its per-tenant counts are right and no cap is exceeded."""
        not_open = sorted(s for s in self.owner if s not in open_ids)
        assert not not_open and len(self.owner) == len(open_ids), (
            "KV control: sessions open in the engine but not registered / registered but not open: "
            f"{len(open_ids)} open in the engine, {len(self.owner)} registered; not open: {not_open[:8]}")
        assert set(self.used) == set(self.owner), "KV control: sessions with a time of last use " \
            f"{sorted(self.used)[:8]} != the open ones {sorted(self.owner)[:8]}"
        counts = Counter(self.owner.values())
        assert counts == self._per_tenant, f"KV control: per-tenant session counts {dict(self._per_tenant)} " \
                                           f"!= {dict(counts)}"
        assert len(self.owner) <= self.limits.max_sessions, f"KV control: {len(self.owner)} sessions open"
        over = [t for t, n in counts.items() if t is not None and n > self.limits.max_sessions_per_tenant]
        assert not over, f"KV control: tenants over max_sessions_per_tenant: {over[:8]}"
        stray = set(self.retention) - set(self.owner)
        assert not stray, f"KV control: retention hints of closed sessions: {sorted(stray)[:8]}"
