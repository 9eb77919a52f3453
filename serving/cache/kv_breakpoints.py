"""Prompt-caching breakpoints (Anthropic's ``cache_control``), engine side: each breakpoint of a
request pins the prefix up to and including its block for its TTL, through the KV control API's
pin leases (serving/cache/kv_control.py), per tenant.

- A breakpoint is a prefix length of the request's (salted) prompt, floored to whole pages, and
  a TTL (cut to ``max_pin_ttl_s``). Its lease is keyed by (tenant, length, a hash of those
  tokens): the same prefix sent again while its lease lives refreshes the lease (as Anthropic
  refreshes a cache entry on a hit) instead of pinning it twice; every live breakpoint lease of
  the tenant that the prompt starts with is refreshed too (a later turn reads the earlier turns'
  pinned prefixes).
- Pinned pages stay in L2 (L1 eviction demotes them, L2 eviction skips them; with L3 they are
  written on) until the lease ends; the next hit loads them back. A flush keeps them.
- Best-effort, as Anthropic's prompt caching is: nothing is refused for its breakpoints.
  :meth:`Breakpoints.apply` runs after the request finished (the prompt's KV is in the tree
  then). A new breakpoint that would take its tenant past its pin quota (its L2 quota, else
  half of L2, in distinct pages), the server past its server-wide pin budget (all tenants'
  pinned pages together: ``max_pinned_l2_fraction`` of L2) or a lease cap (``max_pin_leases``,
  ``max_pin_leases_per_tenant``) first makes room by releasing the same tenant's least
  recently used breakpoints (never the ones this request uses, never an explicit /cache/pin
  lease nor an idle session's, never another tenant's); if that cannot make room, or its KV
  is gone by then (evicted by other requests between the request's end and the pin), or there
  is no L2, the breakpoint is not pinned and the answer says so (``not_pinned``, with the
  reason, naming the bound that refused it; ``released_breakpoints`` counts the ones that gave
  way). The counting and the bounds are KVControl's (:meth:`KVControl.room_for`); nothing is
  counted here.
- Accounting (Anthropic's usage): ``created`` = tokens up to a new breakpoint that this request
  wrote into the cache (those the tree holds after it ran, on L1 or L2, in whole pages) and did not
  read from it, pinned or not: a breakpoint that could not be pinned (no L2, a quota) still counts
  what the request left in the cache, so a later turn never reads what no turn created; by TTL in
  ``created_by_ttl``; counted per tenant in the ledger's request counters
  (``prompt_cache_read_tokens``, ``prompt_cache_creation_tokens``: /metrics).

Concurrency contract: engine loop thread only (it is a part of KVControl).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from serving.cache.kv_control_limits import ControlError

if TYPE_CHECKING:
    from serving.cache.kv_control import KVControl

MAX_BREAKPOINTS = 4  # per request, as Anthropic allows


def prefix_key(tokens: list[int], n: int) -> str:
    return hashlib.blake2b(repr(tokens[:n]).encode(), digest_size=16).hexdigest()


@dataclass
class _Point:
    lease_id: str
    tokens: int  # the prefix length it was asked for (whole pages)
    key: str
    last_used: float  # the lease clock when a request last pinned or refreshed it (LRU: who gives way)


class Breakpoints:
    """A tenant's ``cache_control`` breakpoints as pin leases of ``control`` (the owning
    KVControl): :meth:`apply` after a request finished (see the module docstring for the rules).

    Concurrency contract: the engine loop thread only, as a part of KVControl; no lock, no
    thread, and nothing here waits (the leases' pages are pinned in the tree synchronously).
    """

    def __init__(self, control: KVControl) -> None:
        self.control = control
        self.points: dict[str | None, dict[tuple[int, str], _Point]] = {}  # tenant -> (length, key) -> point

    def _live(self, tenant: str | None) -> dict[tuple[int, str], _Point]:
        pts = self.points.get(tenant, {})
        for k in [k for k, p in pts.items() if p.lease_id not in self.control.leases]:
            del pts[k]  # its lease ended (expired, released, given way)
        if not pts:
            self.points.pop(tenant, None)
        return pts

    def _matching(self, tenant: str | None, tokens: list[int]) -> list[_Point]:
        return [p for (n, key), p in self._live(tenant).items() if n <= len(tokens) and prefix_key(tokens, n) == key]

    def apply(self, tokens: list[int], ends: list[int], ttls: list[float], tenant: str | None,
              read: int, cache_salt: str | None = None, input_ids: list[int] | None = None,
              request_salt: str | None = None) -> dict[str, Any]:
        """Pin (or refresh) each breakpoint; ``read``: the request's tokens served from the cache;
        ``input_ids`` / ``cache_salt`` / ``request_salt``: the unsalted prompt, its effective salt
        and the request's own (kept with the lease). Never raises for a breakpoint that cannot be
        pinned: it is listed in ``not_pinned``."""
        ctl = self.control
        now = ctl.now()
        cap = ctl.limits.max_pin_ttl_s
        ttl_of: dict[int, float] = {}  # prefix length (whole pages) -> the longest TTL asked for it
        for e, ttl in zip(ends, ttls, strict=True):
            n = min(e, len(tokens)) // ctl.page_size * ctl.page_size
            if n:
                ttl_of[n] = max(ttl_of.get(n, 0.0), ttl)
        existing = 0
        matching = self._matching(tenant, tokens)
        for p in matching:  # a hit refreshes it (the longest TTL asked wins)
            lease = ctl.leases[p.lease_id]
            ttl = min(cap, max(ttl_of.get(p.tokens, 0.0), max(ttl_of.values(), default=0.0)))
            lease.expires = max(lease.expires, now + ttl)
            p.last_used = now
            existing = max(existing, lease.tokens)
        in_use = {p.lease_id for p in matching}  # this request's: they never give way to it
        fresh = [(n, ttl) for n, ttl in sorted(ttl_of.items()) if (n, prefix_key(tokens, n)) not in self._live(tenant)]
        made: list[tuple[int, float]] = []  # (pinned tokens, TTL asked) of each new lease
        missed: list[dict[str, Any]] = []
        released = 0
        for n, ttl in fresh:
            try:
                lease_id, gave_way = self._pin(tokens[:n], tenant, min(ttl, cap), in_use,
                                               (list((input_ids or tokens)[:n]), cache_salt, request_salt))
            except ControlError as e:
                missed.append({"tokens": n, "pinned_tokens": 0, "reason": str(e)})
                written = self._cached(tokens, n)  # in the cache unpinned (no L2, say): written all the same
                if written:
                    made.append((written, ttl))
                continue
            released += gave_way
            lease = ctl.leases[lease_id]
            in_use.add(lease_id)
            key = prefix_key(tokens, n)
            self.points.setdefault(tenant, {})[(n, key)] = _Point(lease_id, n, key, now)
            made.append((max(lease.tokens, self._cached(tokens, n)), ttl))
            if lease.tokens < n:
                missed.append({"tokens": n, "pinned_tokens": lease.tokens,
                               "reason": f"only {lease.tokens} of its {n} tokens were on L2 or had L2 room"})
        created_end = max((t for t, _ in made), default=0)
        pinned_end = max((ctl.leases[p.lease_id].tokens for p in self._matching(tenant, tokens)), default=0)
        base = max(read, existing)
        by_ttl: dict[float, int] = {}
        prev = 0
        for i, (end, _ttl) in enumerate(made):  # a segment is held as long as the longest lease covering it
            seg = max(0, min(end, created_end) - max(prev, base))
            if seg:
                ttl = max(t for _, t in made[i:])
                by_ttl[ttl] = by_ttl.get(ttl, 0) + seg
            prev = max(prev, end)
        created = max(0, created_end - base)
        c = ctl.core.ledger.requests.setdefault(tenant, {"requests": 0, "prompt_tokens": 0})
        c["prompt_cache_read_tokens"] = c.get("prompt_cache_read_tokens", 0) + read
        c["prompt_cache_creation_tokens"] = c.get("prompt_cache_creation_tokens", 0) + created
        return {"created_tokens": created, "created_by_ttl": sorted(by_ttl.items()),
                "pinned_tokens": max(pinned_end, existing), "refreshed_tokens": existing, "not_pinned": missed,
                "released_breakpoints": released, "tenant_pinned_pages": ctl.pinned_pages_of(tenant)}

    def _cached(self, tokens: list[int], n: int) -> int:
        """How many of the first ``n`` tokens (whole pages) the tree holds now, on L1 or L2."""
        ps = self.control.page_size
        return min(n, self.control.tree.peek_prefix_len(tokens[:n])) // ps * ps

    def _pin(self, tokens: list[int], tenant: str | None, ttl: float, in_use: set[str],
             origin: tuple[list[int], str | None, str | None]) -> tuple[str, int]:
        """A new lease of ``tokens`` (salted), making room among the tenant's breakpoints not in
        ``in_use``, least recently used first; (its lease id, how many gave way). ControlError:
        not pinned, and nothing was released."""
        ctl = self.control
        if ctl.tree.host is None:
            raise ControlError(400, "this server has no L2 tier (--hicache-ratio): breakpoints pin nothing")
        pages = ctl.lease_pages(tokens)  # 404 when its KV is gone
        victims = sorted((p for p in self._live(tenant).values() if p.lease_id not in in_use),
                         key=lambda p: p.last_used)
        try:
            give_way = ctl.room_for(tenant, pages, [ctl.leases[p.lease_id] for p in victims])
        except ControlError as why:  # even all of them would not do: keep them, pin nothing
            msg = (f"{why}; its older breakpoints could not make room (/cache/pin leases, idle sessions' leases "
                   "and other tenants' pins never give way to a breakpoint)")
            raise ControlError(409, msg) from None
        for lease in give_way:
            ctl.release(lease.lease_id)
        return ctl.hold(tenant, pages, ttl, None, origin)["lease_id"], len(give_way)

    def adopt(self, tokens: list[int], tenant: str | None, lease_id: str) -> None:
        """Make the lease ``lease_id`` (a plain pin of ``tokens``) this tenant's breakpoint of that
        prefix, unless it has one: how a warm drain's target takes a breakpoint lease over."""
        n = len(tokens) // self.control.page_size * self.control.page_size
        if n:
            key = prefix_key(tokens, n)
            point = _Point(lease_id, n, key, self.control.now())
            self.points.setdefault(tenant, {}).setdefault((n, key), point)

    def breakpoint_leases(self) -> set[str]:
        return {p.lease_id for pts in self.points.values() for p in pts.values()}

    def check_integrity(self) -> None:
        for tenant, pts in self.points.items():
            for p in pts.values():
                lease = self.control.leases.get(p.lease_id)
                assert lease is None or lease.tenant == tenant, "cache_control: a breakpoint on another tenant's lease"
