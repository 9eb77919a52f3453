"""Session retention, the KV control's session part (serving/cache/kv_control.py): sessions are
registered per tenant (serving/cache/kv_sessions.py: owners, caps, idle times), and a session
opened with ``demote_on_idle`` has its KV backed up to L2 and pinned there while it is idle (an
idle lease, until its next request or ``ttl_s``, cut to ``max_pin_ttl_s``), instead of leaving it
to be dropped. An idle lease is a pin lease like any other, counted against the tenant's pin
quota, the server-wide pin budget and the lease caps; past any of them it is simply not made
(the KV is left to the usual eviction), and it never makes room by ending other leases.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from serving.cache.kv_control_limits import MAX_TTL_S, ControlError

if TYPE_CHECKING:
    from serving.cache.kv_control import KVControl


class SessionRetention:
    """The session part of one engine's KV control (``KVControl.retention``): it registers
    sessions in ``control.sessions`` and makes and ends idle leases through ``control``'s public
    pin API (:meth:`KVControl.pin_tokens`, :meth:`KVControl.release`, ``control.idle_lease``); the
    pin counting stays KVControl's.

    Concurrency contract: engine loop thread only, as KVControl.
    """

    def __init__(self, control: KVControl) -> None:
        self.control = control
        self.sessions = control.sessions

    def open_session(self, sid: str | None, tenant: str | None, retention: dict[str, Any] | None) -> str:
        """Register a session (a fresh id when ``sid`` is None) for ``tenant``; ControlError 409
        when the id is open, 429 at a cap (serving/cache/kv_sessions.py). The caller then opens it in
        the engine core."""
        sid = sid or uuid.uuid4().hex
        self.sessions.open(sid, tenant, retention)
        return sid

    def check_session(self, sid: str, tenant: str | None) -> None:
        self.sessions.check(sid, tenant)

    def idle_sessions(self, busy: set[str], default_ttl_s: float) -> list[tuple[str, float]]:
        """(session, seconds idle) of the open sessions to close (serving/cache/kv_sessions.py)."""
        return self.sessions.idle(busy, default_ttl_s)

    def session_active(self, sid: str) -> None:
        """A request of ``sid`` was added: it is in use, and its idle lease (if any) ends."""
        self.sessions.touch(sid)
        lease_id = self.control.idle_lease.pop(sid, None)
        if lease_id in self.control.leases:
            self.control.release(lease_id)

    def session_idle(self, sid: str) -> None:
        """The session's last request finished: its idle time starts now; with ``demote_on_idle``,
        keep its KV on L2."""
        self.sessions.touch(sid)
        hints = self.sessions.retention.get(sid)
        ctl = self.control
        if not hints or not hints.get("demote_on_idle") or sid in ctl.idle_lease or ctl.tree.host is None:
            return
        node = ctl.tree.sessions.node_of(sid) if sid in ctl.tree.sessions else None
        if node is None or node.removed:
            return
        tokens = ctl.tree.path_tokens(node)
        ttl = min(float(hints.get("ttl_s", MAX_TTL_S)), ctl.limits.max_pin_ttl_s)
        try:
            lease = ctl.pin_tokens(tokens, self.sessions.owner.get(sid), ttl, session_id=sid)
        except ControlError:
            return  # nothing on L2, past the pin quota, the server-wide pin budget or a lease cap
        ctl.idle_lease[sid] = lease["lease_id"]

    def close_session(self, sid: str) -> None:
        self.session_active(sid)
        self.sessions.close(sid)
