"""The caps of the KV control API's engine side (serving/cache/kv_control.py) and how it refuses a call.

Open sessions and pin leases are objects a client creates with one cheap request and the
engine keeps for up to ``MAX_TTL_S``; the caps keep them bounded. ``*_per_tenant`` caps apply to
the tenants of ``--api-keys-file``; the default tenant (no key, or ``--api-key``) is bounded by
the server-wide cap. Defaults are sized for a 24 GiB machine with room to spare: an open
session costs ~1-2 KB of bookkeeping (ids are at most 256 characters,
serving/server/session_ids.py), a lease a few hundred bytes plus 8 bytes per page; the KV they
keep is bounded by the pools and the pin budgets, not by these counts. ``max_pin_ttl_s`` bounds how
long one explicit pin (``/cache/pin``) or an idle session's lease may hold its pages (a 400 past it
for ``/cache/pin``; an idle lease is cut to it); cache_control breakpoints ask for 5 minutes or 1
hour (Anthropic's TTLs) and are cut to it too.

The L2 pages pins hold are bounded twice, each page counted once however many leases hold it: per
tenant by its pin quota (its L2 quota, else half of L2), and server-wide by
``max_pinned_l2_fraction`` of L2 for all tenants together, so that the rest of L2 stays free to
stage pages through (L1 -> L2 -> L3 write-back, L3 loads, the backups a pin makes): pins of a few
tenants cannot fill L2 for everyone. A tenant's own limit is the smaller of its quota and what the
server-wide budget leaves it.
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
    max_pinned_l2_fraction: float = 0.5  # the L2 pages all tenants' leases may pin together (409 past it)

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_sessions_per_tenant", "max_pin_leases", "max_pin_leases_per_tenant"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        ttl = self.max_pin_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl <= MAX_TTL_S:
            raise ValueError(f"max_pin_ttl_s must be in (0, {MAX_TTL_S:g}], got {ttl!r}")
        frac = self.max_pinned_l2_fraction
        if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 < frac <= 1:
            raise ValueError(f"max_pinned_l2_fraction must be in (0, 1], got {frac!r}")


def lease_cap_refusal(held: int, cap: int, tenant: str | None = None) -> ControlError:
    """429: ``held`` leases are the most the server (``tenant`` None) or ``tenant`` may hold."""
    if tenant is None:
        return ControlError(429, f"{held} pin leases are held, the most this server allows "
                                 f"(max_pin_leases {cap}): release some (DELETE /cache/pin/{{lease_id}})")
    return ControlError(429, f"tenant {tenant!r} holds {held} pin leases, the most a tenant may "
                             f"(max_pin_leases_per_tenant {cap}): release some (DELETE /cache/pin/{{lease_id}}) "
                             "or let them expire")


def quota_refusal(new: int, held: int, quota: int) -> ControlError:
    """409: ``new`` more distinct pages would take a tenant holding ``held`` past its pin quota."""
    return ControlError(409, f"pinning {new} more pages would exceed the {quota}-page pin quota "
                             f"({held} pinned): release a lease or pin a shorter prefix")


def budget_refusal(new: int, pinned: int, budget: int, fraction: float, l2_pages: int) -> ControlError:
    """409: ``new`` more distinct pages would take all tenants' ``pinned`` past the server-wide budget."""
    return ControlError(409, f"pinning {new} more pages would exceed the server-wide pin budget of {budget} L2 "
                             f"pages (max_pinned_l2_fraction {fraction:g} of {l2_pages}; {pinned} pinned by all "
                             "tenants together): release a lease, pin a shorter prefix or try again when other "
                             "pins have ended")
