"""The caps of the KV control API's engine side (serving/cache/kv_control.py) and how it refuses a call.

Open sessions and pin leases are objects a client creates with one cheap request and the
engine keeps for up to ``MAX_TTL_S``; the caps keep them bounded. ``*_per_tenant`` caps apply to
the tenants of ``--api-keys-file``; the default tenant (no key, or ``--api-key``) is bounded by
the server-wide cap. Defaults are sized for a 24 GiB machine with room to spare: an open
session costs ~1-2 KB of bookkeeping (ids are at most 256 characters,
serving/server/session_ids.py), a lease a few hundred bytes plus 8 bytes per page; the KV they
keep is bounded by the pools and the pin quota, not by these counts. ``max_pin_ttl_s`` bounds how
long one explicit pin (``/cache/pin``) or an idle session's lease may hold its pages (a 400 past it
for ``/cache/pin``; an idle lease is cut to it); cache_control breakpoints ask for 5 minutes or 1
hour (Anthropic's TTLs) and are cut to it too.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TTL_S = 24 * 3600.0


class ControlError(Exception):
    """A refused control call: ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ControlLimits:
    max_sessions: int = 4096  # open sessions on this server (--max-sessions): 429 past it
    max_sessions_per_tenant: int = 1024  # open sessions of one --api-keys-file tenant: 429 past it
    max_pin_leases: int = 4096  # pin leases on this server, idle-session leases included (429 past it)
    max_pin_leases_per_tenant: int = 1024  # pin leases of one --api-keys-file tenant: 429 past it
    max_pin_ttl_s: float = 3600.0  # the longest lease (/cache/pin's ttl_s: 400 past it); Anthropic's longest TTL

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_sessions_per_tenant", "max_pin_leases", "max_pin_leases_per_tenant"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        ttl = self.max_pin_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl <= MAX_TTL_S:
            raise ValueError(f"max_pin_ttl_s must be in (0, {MAX_TTL_S:g}], got {ttl!r}")
