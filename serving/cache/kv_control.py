"""The KV control API, engine side: lookups, pin leases, session retention and tenant-bound
sessions (the HTTP routes are serving/server/cache_api.py).

- **lookup**: how many leading tokens of a (salted) prompt are cached on L1, on L2 only, and
  in L3 after them (serving/cache/kv_lookup.py; the L3 count's answer is deferred:
  :meth:`KVControl.poll` hands it back).
- **pin**: a lease that keeps a prefix's KV in L2 (and so in L3, where write-back puts it)
  until it ends: the path's L1-only nodes are backed up to L2 now and its L2 pages pinned
  (``tree.pin_host``: L2 eviction skips them, L1 eviction demotes instead of dropping). A
  tenant's pinned pages are bounded by its L2 quota, or else by half of L2 (its pin quota), and
  all tenants' together by the server-wide pin budget (``max_pinned_l2_fraction`` of L2), which
  keeps the rest of L2 free to stage pages through to L3 and back: 409 past either, each naming
  its bound. A page counts once however many leases hold it, of one tenant or several
  (re-pinning a pinned prefix costs nothing); the leases themselves are capped
  (``max_pin_leases`` and ``max_pin_leases_per_tenant``: 429), their TTL too (``max_pin_ttl_s``:
  400). cache_control breakpoints are leases that make room instead of being refused
  (serving/cache/kv_breakpoints.py: :meth:`KVControl.room_for`); an idle session's lease is
  simply not made past a bound.
- **flush**: a cache flush keeps every lease (breakpoints and idle sessions' included): the
  nodes holding a leased page stay, on L2 only, and everything else goes
  (``EngineCore.flush_cache(keep=held_pages())``); :meth:`KVControl.flushed` says what it kept.
- **session retention** (``/open_session`` hints): ``ttl_s`` closes the session after that
  long idle; ``demote_on_idle`` backs the session's KV up to L2 and pins it there while the
  session is idle (until its next request, or ``ttl_s``), instead of leaving it to be dropped.
- Sessions belong to the tenant that opened them; another tenant gets "unknown session". Who
  owns which, and the caps on open sessions, are serving/cache/kv_sessions.py's; the session
  methods (retention included) are serving/cache/kv_retention.py's (KVControl's base class).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from hicache import salt
from serving.cache.control_core import ControlCore
from serving.cache.kv_breakpoints import Breakpoints
from serving.cache.kv_control_integrity import check_control
from serving.cache.kv_control_limits import (
    MAX_TTL_S,
    ControlError,
    ControlLimits,
    budget_refusal,
    lease_cap_refusal,
    quota_refusal,
)
from serving.cache.kv_drain import drain_report
from serving.cache.kv_lookup import PrefixLookup
from serving.cache.kv_retention import SessionRetention
from serving.cache.kv_sessions import SessionRegistry

__all__ = ["MAX_TTL_S", "ControlError", "ControlLimits", "KVControl", "Lease"]


@dataclass
class Lease:
    lease_id: str
    tenant: str | None
    pages: list[int]  # pinned L2 pages
    tokens: int
    expires: float  # KVControl.now()
    session_id: str | None = None
    input_ids: list[int] | None = None  # the prompt it pins, unsalted (a drain re-pins it elsewhere)
    cache_salt: str | None = None  # its effective salt
    request_salt: str | None = None  # the request's own cache_salt (a drain re-pins it with this + the tenant)


class KVControl:
    """The KV control operations of one engine (see the module docstring for what each does).

    It is the one owner of the pin counting: which L2 pages each tenant's leases hold, which all
    leases hold (the server-wide budget), how many leases each tenant has; every lease is made
    (:meth:`hold`) and ended (:meth:`_release`) here, past :meth:`refusal` or :meth:`room_for`.

    Concurrency contract: engine loop thread only (it owns the tree, the leases and the pins),
    except the L3 existence check of a lookup, which runs on PrefixLookup's worker thread
    (serving/cache/kv_lookup.py); :meth:`poll` hands its answers back on the loop thread.
    """

    def __init__(self, core: ControlCore, limits: ControlLimits | None = None) -> None:
        self.core = core
        self.tree = core.tree
        self.page_size = core.config.cache.page_size
        self.limits = limits or ControlLimits()
        self.leases: dict[str, Lease] = {}
        # tenant -> L2 page -> how many of its leases hold it (its pin quota counts the pages once)
        self._pinned: dict[str | None, Counter[int]] = {}
        self._all_pinned: Counter[int] = Counter()  # L2 page -> how many leases hold it (any tenant's)
        self._lease_count: Counter[str | None] = Counter()  # tenant -> its leases
        self.sessions = SessionRegistry(self.limits)
        self.idle_lease: dict[str, str] = {}  # session -> lease held while it is idle
        self._ids = itertools.count(1)
        self.lookups = PrefixLookup(core)  # /cache/lookup (its L3 check on a worker thread)
        self.clock_skew = 0.0  # seconds added to the lease clock (/debug/advance_kv_clock: tests)
        self.breakpoints = Breakpoints(self)  # cache_control breakpoints (serving/cache/kv_breakpoints.py)
        self.retention = SessionRetention(self)  # sessions and their idle leases (serving/cache/kv_retention.py)

    def now(self) -> float:
        """The lease clock: time.monotonic(), moved on by ``clock_skew``."""
        return time.monotonic() + self.clock_skew

    def call(self, op: str, args: dict[str, Any], tenant: str | None) -> Any:
        """One control call from the HTTP process (a value, or a Future answered later). Leases
        whose time is up end first, so no call sees one (the loop's sweep may not have run yet)."""
        self.expire()
        ops = {
            "lookup": lambda: self.lookups.lookup(args["input_ids"], args.get("cache_salt")),
            "pin": lambda: self.pin(args["input_ids"], args.get("cache_salt"), tenant, float(args["ttl_s"]),
                                    request_salt=args.get("request_salt"), breakpoint=bool(args.get("breakpoint"))),
            "unpin": lambda: self.unpin(args["lease_id"], tenant),
            "cache_control": lambda: self.breakpoints.apply(self._salted(args), args["ends"], args["ttls"], tenant,
                                                            int(args["read"]), args.get("cache_salt"),
                                                            args["input_ids"], args.get("request_salt")),
            "advance_clock": lambda: self._advance(float(args["seconds"])),
            "drain": lambda: drain_report(self),
        }
        if op not in ops:
            raise ControlError(400, f"unknown KV control operation {op!r}")
        return ops[op]()

    def _salted(self, args: dict[str, Any]) -> list[int]:
        return salt.apply(args["input_ids"], salt.salt_tags(args.get("cache_salt")))

    def _advance(self, seconds: float) -> dict[str, float]:
        if not 0 <= seconds <= MAX_TTL_S:
            raise ControlError(400, f"seconds must be in [0, {MAX_TTL_S:g}]")
        self.clock_skew += seconds
        self.expire()
        return {"clock_skew_s": self.clock_skew}

    # -- lookups (serving/cache/kv_lookup.py) -------------------------------------------
    def defer(self, call_id: int, future: Future) -> None:
        self.lookups.defer(call_id, future)

    @property
    def busy(self) -> bool:
        return self.lookups.busy

    def poll(self) -> list[tuple[int, Any, Exception | None]]:
        """Deferred answers that are ready: (call_id, value, error)."""
        return self.lookups.poll()

    # -- pins ---------------------------------------------------------------------------
    def pin(self, input_ids: list[int], cache_salt: str | None, tenant: str | None, ttl_s: float,
            session_id: str | None = None, request_salt: str | None = None, breakpoint: bool = False) -> dict[str, Any]:
        """``breakpoint``: the lease is also a cache_control breakpoint of this prefix (a drain
        re-homes one so: a later request's breakpoint on it refreshes it, kv_breakpoints.py)."""
        if self.tree.host is None:
            raise ControlError(400, "pinning keeps KV in L2: this server has no L2 tier (--hicache-ratio)")
        cap = self.limits.max_pin_ttl_s
        if not 0 < ttl_s <= cap:
            raise ControlError(400, f"ttl_s must be in (0, {cap:g}], got {ttl_s:g}: this server pins for at most "
                                    f"{cap:g} s (max_pin_ttl_s); pin again before the lease ends to keep it")
        tokens = salt.apply(input_ids, salt.salt_tags(cache_salt))
        out = self.pin_tokens(tokens, tenant, ttl_s, session_id, (input_ids, cache_salt, request_salt))
        if breakpoint:
            self.breakpoints.adopt(tokens, tenant, out["lease_id"])
        return out

    def refusal(self, tenant: str | None, pages: list[int] | None = None) -> ControlError | None:
        """Why ``tenant`` may not take one more lease (a lease cap: 429), or one of ``pages`` (its
        pin quota, or the server-wide pin budget, in distinct pages: 409); None when it may."""
        if len(self.leases) >= self.limits.max_pin_leases:
            return lease_cap_refusal(len(self.leases), self.limits.max_pin_leases)
        cap = self.limits.max_pin_leases_per_tenant
        if tenant is not None and self._lease_count[tenant] >= cap:
            return lease_cap_refusal(self._lease_count[tenant], cap, tenant)
        if pages is None:
            return None
        held = self._pinned.get(tenant, Counter())
        new = len(set(pages).difference(held))  # pages this tenant's leases already hold count once
        if len(held) + new > self.pin_quota(tenant):
            return self._over_quota(tenant, new)
        new = len(set(pages).difference(self._all_pinned))  # pages any lease holds count once
        if len(self._all_pinned) + new > self.pin_budget():
            return self._over_budget(new)
        return None

    def _over_quota(self, tenant: str | None, new: int) -> ControlError:
        return quota_refusal(new, self.pinned_pages_of(tenant), self.pin_quota(tenant))

    def _over_budget(self, new: int) -> ControlError:
        return budget_refusal(new, len(self._all_pinned), self.pin_budget(), self.limits.max_pinned_l2_fraction,
                              self.tree.host.num_pages)

    def room_for(self, tenant: str | None, pages: list[int], candidates: list[Lease]) -> list[Lease]:
        """The fewest leading ``candidates`` (leases of ``tenant``, in the order they give way)
        whose release lets a new lease of ``pages`` pass :meth:`refusal`: [] when it passes now.
        Raises the ControlError that would still refuse it when releasing all of them would not
        do (a lease cap, the tenant's pin quota or the server-wide pin budget)."""
        lim = self.limits
        over_leases = len(self.leases) + 1 - lim.max_pin_leases
        if tenant is not None:
            over_leases = max(over_leases, self._lease_count[tenant] + 1 - lim.max_pin_leases_per_tenant)
        held, every = self._pinned.get(tenant, Counter()), self._all_pinned
        want = set(pages)
        new_quota, new_budget = len(want.difference(held)), len(want.difference(every))
        over_quota = len(held) + new_quota - self.pin_quota(tenant)
        over_budget = len(every) + new_budget - self.pin_budget()
        out: list[Lease] = []
        gone: Counter[int] = Counter()
        for lease in candidates:
            if max(over_leases, over_quota, over_budget) <= 0:
                break
            out.append(lease)
            over_leases -= 1
            for p in lease.pages:
                gone[p] += 1
                if p not in want:
                    over_quota -= gone[p] == held[p]  # no lease of the tenant holds it any more
                    over_budget -= gone[p] == every[p]  # no lease at all holds it any more
        if max(over_leases, over_quota, over_budget) <= 0:
            return out
        if over_leases > 0:
            raise self.refusal(tenant) or AssertionError("over a lease cap, yet refusal() passes")
        raise self._over_quota(tenant, new_quota) if over_quota > 0 else self._over_budget(new_budget)

    def lease_pages(self, tokens: list[int]) -> list[int]:
        """The L2 pages of ``tokens``' cached prefix (salted; whole pages), its L1-only part backed
        up to L2 first, as far as L2 has room; 404 when none is cached, 409 when L2 has no room."""
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        self.tree.backup_prefix(tokens[:n])
        self.core.req_cache.flush_transfers()  # the backups run before anything reads those pages
        pages: list[int] = []
        short = False
        for node, _pos, m in self.tree.walk(tokens, n):
            if node.host_pages is None:
                short = True
                break  # no L2 room for its backup: the lease covers what is on L2
            pages += node.host_pages[: m // ps]
        if not pages and short:
            raise ControlError(409, "its KV is on L1, but L2 has no room for the copy a pin holds (L2 is full of "
                                    "pinned pages and copies of L1 pages): try again later")
        if not pages:
            raise ControlError(404, "nothing of this prompt is cached (send it once, or /cache/prefetch it)")
        return pages

    def hold(self, tenant: str | None, pages: list[int], ttl_s: float, session_id: str | None = None,
             origin: tuple[list[int] | None, str | None, str | None] = (None, None, None)) -> dict[str, Any]:
        """A new lease of ``pages`` (from :meth:`lease_pages`, past :meth:`refusal`) for ``ttl_s``."""
        self.tree.pin_host(pages)
        self._pinned.setdefault(tenant, Counter()).update(pages)
        self._all_pinned.update(pages)
        self._lease_count[tenant] += 1
        lease = Lease(f"lease-{next(self._ids)}-{time.monotonic_ns() % 10**9}", tenant, pages,
                      len(pages) * self.page_size, self.now() + ttl_s, session_id, *origin)
        self.leases[lease.lease_id] = lease
        return {"lease_id": lease.lease_id, "pinned_tokens": lease.tokens, "ttl_s": ttl_s}

    def pin_tokens(self, tokens: list[int], tenant: str | None, ttl_s: float, session_id: str | None = None,
                    origin: tuple[list[int] | None, str | None, str | None] = (None, None, None)) -> dict[str, Any]:
        err = self.refusal(tenant)  # a lease cap first: refused before any backup
        if err is not None:
            raise err
        pages = self.lease_pages(tokens)
        err = self.refusal(tenant, pages)
        if err is not None:
            raise err
        return self.hold(tenant, pages, ttl_s, session_id, origin)

    def pinned_pages_of(self, tenant: str | None) -> int:
        return len(self._pinned.get(tenant, ()))

    def tenant_snapshot(self) -> dict[str, Any]:
        """The ledger's per-tenant snapshot, each row with its ``pinned_pages`` (gauge)."""
        snap = self.core.ledger.snapshot()
        for tenant, pages in self._pinned.items():
            row = snap.get("default" if tenant is None else tenant, snap.get("_other"))
            if row is not None:
                row["pinned_pages"] = row.get("pinned_pages", 0) + len(pages)
        return snap

    def pin_quota(self, tenant: str | None) -> int:
        """``tenant``'s pin quota in distinct L2 pages: its L2 quota, else half of L2."""
        quota = self.core.ledger.quotas.get(tenant, {}) if tenant is not None else {}
        return int(quota.get("host", self.tree.host.num_pages // 2))

    def pin_budget(self) -> int:
        """The server-wide pin budget: distinct L2 pages all leases together may pin."""
        return int(self.tree.host.num_pages * self.limits.max_pinned_l2_fraction)

    def pin_limit(self, tenant: str | None) -> int:
        """The most distinct L2 pages ``tenant`` may pin now: its pin quota, or what the server-wide
        budget leaves it (the budget less the pages only other tenants' leases hold), the smaller."""
        others = len(self._all_pinned) - self.pinned_pages_of(tenant)
        return min(self.pin_quota(tenant), self.pin_budget() - others)

    def unpin(self, lease_id: str, tenant: str | None) -> dict[str, Any]:
        lease = self.leases.get(lease_id)
        if lease is None or lease.tenant != tenant:  # another tenant's lease is "not found" too
            raise ControlError(404, f"unknown or expired lease {lease_id!r}")
        self._release(lease)
        return {"released": lease_id, "pinned_tokens": lease.tokens}

    def _release(self, lease: Lease) -> None:
        del self.leases[lease.lease_id]
        self.tree.unpin_host(lease.pages)
        held = self._pinned[lease.tenant]
        held.subtract(lease.pages)
        self._all_pinned.subtract(lease.pages)
        for p in lease.pages:
            if held[p] <= 0:
                del held[p]
            if self._all_pinned[p] <= 0:
                del self._all_pinned[p]
        if not held:
            del self._pinned[lease.tenant]
        self._lease_count[lease.tenant] -= 1
        if not self._lease_count[lease.tenant]:
            del self._lease_count[lease.tenant]
        if lease.session_id is not None and self.idle_lease.get(lease.session_id) == lease.lease_id:
            del self.idle_lease[lease.session_id]

    def expire(self, now: float | None = None) -> None:
        now = self.now() if now is None else now
        for lease in [x for x in self.leases.values() if x.expires <= now]:
            self._release(lease)

    def release(self, lease_id: str) -> None:
        """End a lease now (a breakpoint's giving way: kv_breakpoints.py)."""
        self._release(self.leases[lease_id])

    def release_all(self) -> None:
        for lease in list(self.leases.values()):
            self._release(lease)

    def held_pages(self) -> set[int]:
        """The L2 pages some lease holds: a flush keeps them (:meth:`flushed`)."""
        return {p for lease in self.leases.values() for p in lease.pages}

    def flushed(self) -> dict[str, int]:
        """After a flush that kept :meth:`held_pages` (``EngineCore.flush_cache``): what it kept.
        Every lease and breakpoint lives on, its pages in L2, so a later DELETE still finds it."""
        points = self.breakpoints.breakpoint_leases()
        return {"kept_leases": len(self.leases), "kept_breakpoints": len(points & self.leases.keys()),
                "kept_pinned_pages": len(self.held_pages())}

    def check_integrity(self) -> None:
        """Raise AssertionError unless the pin counting matches the leases and every bound holds
        (the tenants' pin quotas, the server-wide pin budget, the lease caps), and sessions and
        breakpoints agree with it (serving/cache/kv_control_integrity.py)."""
        check_control(self, self._pinned, self._all_pinned, self._lease_count)

    @property
    def pinned_pages(self) -> int:
        """Pages pinned, each counted once per tenant holding it."""
        return sum(len(x) for x in self._pinned.values())

    @property
    def server_pinned_pages(self) -> int:
        """Distinct L2 pages pinned by all leases together (what the server-wide budget bounds)."""
        return len(self._all_pinned)

    def shutdown(self) -> None:
        self.lookups.shutdown()
