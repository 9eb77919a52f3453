"""Open sessions as the KV control API sees them: who owns each, its ``/open_session`` retention
hints, and the caps on how many may be open (serving/cache/kv_control_limits.py).

- Opening an id that is open is a 409: "already open" for its own tenant (as SGLang refuses
  it: "Check if a session with the same id is still open"), "taken" for another tenant's.
- Past ``max_sessions`` open sessions, or ``max_sessions_per_tenant`` of one keys-file tenant,
  opening is a 429 naming the cap; closing one (or its idle timeout) makes room.
- Another tenant's session is "unknown session_id" (a KeyError: 404), as if it did not exist.

The engine core keeps its own set of open ids (``EngineCore.sessions``, what a request's
``session_id`` is checked against); :meth:`SessionRegistry.check_integrity` checks both agree.

Concurrency contract: engine loop thread only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from serving.cache.kv_control_limits import ControlError, ControlLimits


class SessionRegistry:
    """See the module docstring."""

    def __init__(self, limits: ControlLimits) -> None:
        self.limits = limits
        self.owner: dict[str, str | None] = {}  # open session -> its tenant (None: the default one)
        self.retention: dict[str, dict[str, Any]] = {}  # session -> its /open_session hints
        self._per_tenant: Counter[str | None] = Counter()

    def __contains__(self, sid: str) -> bool:
        return sid in self.owner

    def __len__(self) -> int:
        return len(self.owner)

    def admit(self, sid: str, tenant: str | None) -> None:
        """Raise ControlError (409 / 429) unless ``tenant`` may open ``sid`` now."""
        if sid in self.owner:
            if self.owner[sid] == tenant:
                raise ControlError(409, f"session_id {sid!r} is already open: close it first (/close_session), "
                                        "or open a session without session_id to get a fresh id")
            raise ControlError(409, f"session_id {sid!r} is taken")
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
        if retention:
            self.retention[sid] = dict(retention)

    def check(self, sid: str, tenant: str | None) -> None:
        """KeyError (404) when ``sid`` is another tenant's session."""
        if sid in self.owner and self.owner[sid] != tenant:
            raise KeyError(f"unknown session_id {sid!r}")

    def close(self, sid: str) -> None:
        if sid in self.owner:
            tenant = self.owner.pop(sid)
            self._per_tenant[tenant] -= 1
            if not self._per_tenant[tenant]:
                del self._per_tenant[tenant]
        self.retention.pop(sid, None)

    def check_integrity(self, open_ids: set[str]) -> None:
        """Raise AssertionError unless the registry holds exactly the engine's open sessions,
        its per-tenant counts are right and no cap is exceeded."""
        assert set(self.owner) == open_ids, (
            "KV control: sessions open in the engine but not registered / registered but not open: "
            f"{sorted(open_ids - set(self.owner))[:8]} / {sorted(set(self.owner) - open_ids)[:8]}")
        counts = Counter(self.owner.values())
        assert counts == self._per_tenant, f"KV control: per-tenant session counts {dict(self._per_tenant)} " \
                                           f"!= {dict(counts)}"
        assert len(self.owner) <= self.limits.max_sessions, f"KV control: {len(self.owner)} sessions open"
        over = [t for t, n in counts.items() if t is not None and n > self.limits.max_sessions_per_tenant]
        assert not over, f"KV control: tenants over max_sessions_per_tenant: {over[:8]}"
        stray = set(self.retention) - set(self.owner)
        assert not stray, f"KV control: retention hints of closed sessions: {sorted(stray)[:8]}"
