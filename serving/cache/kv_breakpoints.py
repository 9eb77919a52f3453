"""Prompt-caching breakpoints (Anthropic's ``cache_control``), engine side: each breakpoint of a
request pins the prefix up to and including its block for its TTL, through the KV control API's
pin leases (serving/cache/kv_control.py), per tenant.

- A breakpoint is a prefix length of the request's (salted) prompt, floored to whole pages, and
  a TTL. Its lease is keyed by (tenant, length, a hash of those tokens): the same prefix sent
  again while its lease lives refreshes the lease (as Anthropic refreshes a cache entry on a
  hit) instead of pinning it twice; every live breakpoint lease of the tenant that the prompt
  starts with is refreshed too (a later turn reads the earlier turns' pinned prefixes).
- Pinned pages stay in L2 (L1 eviction demotes them, L2 eviction skips them; with L3 they are
  written on) until the lease ends; the next hit loads them back.
- :meth:`Breakpoints.admit` runs before the request does: a tenant that would go over its pin
  page quota (its L2 quota, else half of L2) or over its lease cap gets a 429 before any work.
  Without L2 (no ``--hicache-ratio`` nor L3) nothing can be pinned: breakpoints are accepted
  and report ``cache_creation_input_tokens`` 0, as clients that always send them expect.
  :meth:`Breakpoints.apply` runs after it finished (the prompt's KV is in the tree then); a
  breakpoint that cannot be pinned then (its KV already gone, a quota reached by a concurrent
  request) is reported as not pinned, never as an error of a request already answered.
- Accounting (Anthropic's usage): ``created`` = tokens of newly pinned prefixes that were not
  served from the cache; counted per tenant in the ledger's request counters
  (``prompt_cache_read_tokens``, ``prompt_cache_creation_tokens``: /metrics).

Concurrency contract: engine loop thread only (it is a part of KVControl).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from serving.cache.kv_control_limits import ControlError

MAX_BREAKPOINTS = 4  # per request, as Anthropic allows


def prefix_key(tokens: list[int], n: int) -> str:
    return hashlib.blake2b(repr(tokens[:n]).encode(), digest_size=16).hexdigest()


@dataclass
class _Point:
    lease_id: str
    tokens: int  # the prefix length it was asked for (whole pages)
    key: str


class Breakpoints:
    """A tenant's ``cache_control`` breakpoints as pin leases of ``control`` (the owning
    KVControl): :meth:`admit` before a request runs, :meth:`apply` after it finished (see the
    module docstring for the rules).

    Concurrency contract: the engine loop thread only, as a part of KVControl; no lock, no
    thread, and nothing here waits (the leases' pages are pinned in the tree synchronously).
    """

    def __init__(self, control: Any) -> None:
        self.control = control
        self.points: dict[str | None, dict[tuple[int, str], _Point]] = {}  # tenant -> (length, key) -> point

    def _live(self, tenant: str | None) -> dict[tuple[int, str], _Point]:
        pts = self.points.get(tenant, {})
        for k in [k for k, p in pts.items() if p.lease_id not in self.control.leases]:
            del pts[k]  # its lease ended (expired, released, flushed)
        if not pts:
            self.points.pop(tenant, None)
        return pts

    def _lengths(self, tokens: list[int], ends: list[int]) -> list[int]:
        ps = self.control.page_size
        return sorted({min(e, len(tokens)) // ps * ps for e in ends} - {0})

    def _matching(self, tenant: str | None, tokens: list[int]) -> list[_Point]:
        return [p for (n, key), p in self._live(tenant).items() if n <= len(tokens) and prefix_key(tokens, n) == key]

    def admit(self, tokens: list[int], ends: list[int], tenant: str | None) -> dict[str, Any]:
        """429 when pinning these breakpoints would take the tenant past its pinned pages or leases."""
        ctl = self.control
        if ctl.tree.host is None:  # pins live in L2: without it a breakpoint is accepted and pins nothing
            return {"new_pages": 0, "pinning": False}
        lengths = self._lengths(tokens, ends)
        have = {p.tokens for p in self._matching(tenant, tokens)}
        fresh = [n for n in lengths if n not in have]
        if not fresh:
            return {"new_pages": 0}
        held = ctl.pinned_pages_of(tenant)
        covered = max(have, default=0)
        new_pages = max(0, (max(fresh) - covered) // ctl.page_size)
        limit = ctl.pin_limit(tenant)
        if held + new_pages > limit:
            raise ControlError(429, f"cache_control: pinning {new_pages} more pages would take "
                                    f"{'the default tenant' if tenant is None else repr(tenant)} past its "
                                    f"{limit} pinned pages ({held} pinned): wait for a breakpoint's TTL to "
                                    "end, or put the breakpoint on a shorter prefix")
        cap = ctl.lease_cap(tenant)
        if ctl.lease_count(tenant) + len(fresh) > cap:
            raise ControlError(429, f"cache_control: {ctl.lease_count(tenant)} pin leases are held and this "
                                    f"request adds {len(fresh)}; at most {cap} may be held "
                                    "(max_pin_leases / max_pin_leases_per_tenant)")
        return {"new_pages": new_pages}

    def apply(self, tokens: list[int], ends: list[int], ttls: list[float], tenant: str | None,
              read: int, cache_salt: str | None = None, input_ids: list[int] | None = None,
              request_salt: str | None = None) -> dict[str, Any]:
        """Pin (or refresh) each breakpoint; ``read``: the request's tokens served from the cache;
        ``input_ids`` / ``cache_salt`` / ``request_salt``: the unsalted prompt, its effective salt
        and the request's own (kept with the lease)."""
        ctl = self.control
        now = ctl.now()
        ttl_of: dict[int, float] = {}
        for e, ttl in zip(ends, ttls, strict=True):
            n = min(e, len(tokens)) // ctl.page_size * ctl.page_size
            if n:
                ttl_of[n] = max(ttl_of.get(n, 0.0), ttl)
        existing = 0
        for p in self._matching(tenant, tokens):  # a hit refreshes it (the longest TTL asked wins)
            lease = ctl.leases[p.lease_id]
            ttl = max(ttl_of.get(p.tokens, 0.0), max(ttl_of.values(), default=0.0))
            lease.expires = max(lease.expires, now + ttl)
            existing = max(existing, lease.tokens)
        created_end, missed = 0, []
        pts = self.points.setdefault(tenant, {})
        for n, ttl in sorted(ttl_of.items()):
            key = prefix_key(tokens, n)
            if (n, key) in pts:
                continue
            try:
                out = ctl.pin_prefix(tokens[:n], tenant, ttl, (list((input_ids or tokens)[:n]), cache_salt,
                                                                      request_salt))
            except ControlError as e:
                missed.append({"tokens": n, "status": e.status, "reason": str(e)})
                continue
            pts[(n, key)] = _Point(out["lease_id"], n, key)
            created_end = max(created_end, out["pinned_tokens"])
        if not pts:
            self.points.pop(tenant, None)
        created = max(0, created_end - max(read, existing))
        c = ctl.core.ledger.requests.setdefault(tenant, {"requests": 0, "prompt_tokens": 0})
        c["prompt_cache_read_tokens"] = c.get("prompt_cache_read_tokens", 0) + read
        c["prompt_cache_creation_tokens"] = c.get("prompt_cache_creation_tokens", 0) + created
        return {"created_tokens": created, "pinned_tokens": max(created_end, existing),
                "refreshed_tokens": existing, "not_pinned": missed,
                "tenant_pinned_pages": ctl.pinned_pages_of(tenant)}

    def adopt(self, tokens: list[int], tenant: str | None, lease_id: str) -> None:
        """Make the lease ``lease_id`` (a plain pin of ``tokens``) this tenant's breakpoint of that
        prefix, unless it has one: how a warm drain's target takes a breakpoint lease over."""
        n = len(tokens) // self.control.page_size * self.control.page_size
        if n:
            key = prefix_key(tokens, n)
            self.points.setdefault(tenant, {}).setdefault((n, key), _Point(lease_id, n, key))

    def breakpoint_leases(self) -> set[str]:
        return {p.lease_id for pts in self.points.values() for p in pts.values()}

    def check_integrity(self) -> None:
        for tenant, pts in self.points.items():
            for p in pts.values():
                lease = self.control.leases.get(p.lease_id)
                assert lease is None or lease.tenant == tenant, "cache_control: a breakpoint on another tenant's lease"
