"""Per-tenant page accounting and soft quotas for the HiRadixTree.

A salted sequence's tree nodes all hang below a top-level node whose first ids carry the salt
(hicache.salt), so a node's owner is the tenant registered for the salt of its top-level
ancestor (unsalted, or a salt never registered: the default tenant, ``None``).

:class:`TenantLedger` listens to the tree (``add_listener``) and keeps, per salt and per tenant,
the pages held on L1 ("device") and L2 ("host"), plus pages written to L3 ("storage", counted
by :meth:`add_stored`; L3 evicts on its own, so that count is pages written, not pages held),
and the L3 pages a tenant has in flight (:meth:`reserve_storage` until :meth:`settle_storage`).
Quotas are soft (as LMCache's): nothing is refused; when the tree evicts, nodes of tenants
over their quota on that tier go first (:meth:`eviction_key`), then the usual policy order,
so a tenant flooding the cache evicts its own pages before anyone else's. An L3 write-back
writes no more of a tenant's pages than its L3 quota has room for (:meth:`storage_room`),
counting the writes still in flight, so writes submitted together cannot overshoot it.

Not thread-safe: the scheduler thread owns it, like the tree. Bounded: salts with no page left
are forgotten once more than ``max_salts`` are registered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hicache import salt
from hicache.hiradix.node import TreeNode

TIERS = ("device", "host", "storage")
_SIGN = {"device_add": ("device", 1), "device_evict": ("device", -1), "host_add": ("host", 1),
         "host_evict": ("host", -1)}


class TenantLedger:
    def __init__(self, page_size: int, quotas: Mapping[str, Mapping[str, int]] | None = None,
                 max_salts: int = 65536) -> None:
        self.page_size = page_size
        self.quotas = {t: dict(q) for t, q in (quotas or {}).items()}
        for t, q in self.quotas.items():
            if set(q) - set(TIERS) or any(v <= 0 for v in q.values()):
                raise ValueError(f"tenant {t!r}: quotas are positive page counts for {', '.join(TIERS)}")
        self.max_salts = max_salts
        self.owner: dict[tuple[int, ...], str | None] = {}
        self.by_salt: dict[tuple[int, ...] | None, dict[str, int]] = {}
        self.by_tenant: dict[str | None, dict[str, int]] = {}
        # requests, per tenant: prompt tokens and cached tokens by tier (counters)
        self.requests: dict[str | None, dict[str, int]] = {}
        self.storage_reserved: dict[str | None, int] = {}  # L3 pages in flight, per tenant

    # -- who owns what ------------------------------------------------------------------
    def register(self, tags: tuple[int, ...], tenant: str | None) -> None:
        """Salt ``tags`` belong to ``tenant`` (called for each request before it touches the tree)."""
        if not tags or self.owner.get(tags, 0) == tenant:
            return
        if tags in self.owner and self.by_salt.get(tags):
            return  # pages are counted for the first owner (a tenant's salt is derived from it anyway)
        if len(self.owner) >= self.max_salts:
            for t in [t for t in self.owner if not any(self.by_salt.get(t, {}).values())]:
                del self.owner[t]
                self.by_salt.pop(t, None)
        self.owner[tags] = tenant

    def salt_of(self, node: TreeNode) -> tuple[int, ...] | None:
        top = node
        while top.parent is not None and top.parent.parent is not None:
            top = top.parent
        return salt.salt_of(top.key)

    def owner_of(self, tags: tuple[int, ...] | None) -> str | None:
        """The tenant registered for salt ``tags`` (None: unsalted, unregistered, or the default)."""
        return None if tags is None else self.owner.get(tags)

    def tenant_of(self, node: TreeNode) -> str | None:
        return self.owner_of(self.salt_of(node))

    # -- counting -------------------------------------------------------------------------
    def on_tree_event(self, kind: str, node: TreeNode) -> None:
        if kind == "reset":
            for counts in (*self.by_salt.values(), *self.by_tenant.values()):
                counts["device"] = counts["host"] = 0
            return
        if kind == "remove":
            if node.host_pages is None:
                return
            tier, sign = "host", -1
        else:
            tier, sign = _SIGN[kind]
        self._add(self.salt_of(node), tier, sign * (len(node.key) // self.page_size))

    def add_stored(self, tokens: list[int], pages: int) -> None:
        """``pages`` of the sequence ``tokens`` (as the tree keys it) were written to L3."""
        self._add(salt.salt_of(tokens), "storage", pages)

    def reserve_storage(self, tokens: list[int], pages: int) -> str | None:
        """An L3 write of ``pages`` of ``tokens`` is submitted: they count against its tenant's
        quota until :meth:`settle_storage`. Returns the tenant, to hand back there."""
        tenant = self.owner_of(salt.salt_of(tokens))
        self.storage_reserved[tenant] = self.storage_reserved.get(tenant, 0) + pages
        return tenant

    def settle_storage(self, tenant: str | None, reserved: int, tokens: list[int], wrote: int) -> None:
        """The write reserved by :meth:`reserve_storage` finished, having written ``wrote`` pages."""
        left = self.storage_reserved.get(tenant, 0) - reserved
        if left > 0:
            self.storage_reserved[tenant] = left
        else:
            self.storage_reserved.pop(tenant, None)
        if wrote:
            self.add_stored(tokens, wrote)

    def _add(self, tags: tuple[int, ...] | None, tier: str, n: int) -> None:
        tenant = self.owner_of(tags)
        for table, k in ((self.by_salt, tags), (self.by_tenant, tenant)):
            counts = table.get(k)
            if counts is None:
                counts = table[k] = dict.fromkeys(TIERS, 0)
            counts[tier] += n

    def record(self, tenant: str | None, prompt_tokens: int, cached_by_tier: Mapping[str, int]) -> None:
        """A finished request of ``tenant``: its prompt tokens and those served from each tier."""
        c = self.requests.setdefault(tenant, {"requests": 0, "prompt_tokens": 0})
        c["requests"] += 1
        c["prompt_tokens"] += prompt_tokens
        for tier, n in cached_by_tier.items():
            c[f"cached_{tier}"] = c.get(f"cached_{tier}", 0) + n

    def snapshot(self, max_tenants: int = 256) -> dict[str, dict[str, object]]:
        """Per-tenant pages, quotas and request counters (``"default"`` for the default tenant;
        past ``max_tenants`` names the rest are summed under ``"_other"``: bounded label sets)."""
        names = sorted({*self.by_tenant, *self.requests, *self.quotas} - {None})
        out: dict[str, dict[str, object]] = {}
        for i, t in enumerate([None, *names]):
            label = "default" if t is None else (t if i <= max_tenants else "_other")
            row = out.setdefault(label, {"pages": dict.fromkeys(TIERS, 0), "quota_pages": {}, "requests": {}})
            for tier in TIERS:
                row["pages"][tier] += self.pages(t, tier)
            if t is not None and label == t:
                row["quota_pages"] = dict(self.quotas.get(t, {}))
            for k, v in self.requests.get(t, {}).items():
                row["requests"][k] = row["requests"].get(k, 0) + v
        return out

    def pages(self, tenant: str | None, tier: str) -> int:
        return self.by_tenant.get(tenant, {}).get(tier, 0)

    # -- quotas ---------------------------------------------------------------------------
    def over(self, tenant: str | None, tier: str) -> bool:
        q = self.quotas.get(tenant, {}).get(tier) if tenant is not None else None
        return q is not None and self.pages(tenant, tier) > q

    def storage_room(self, tokens: list[int]) -> int | None:
        """How many more pages of ``tokens``' tenant may be written to L3, counting the pages
        already written and those in flight (None: no L3 quota)."""
        tenant = self.owner_of(salt.salt_of(tokens))
        q = self.quotas.get(tenant, {}).get("storage") if tenant is not None else None
        if q is None:
            return None
        return max(0, q - self.pages(tenant, "storage") - self.storage_reserved.get(tenant, 0))

    def eviction_key(self, tier: str, base: Callable[[TreeNode], tuple]) -> Callable[[TreeNode], tuple]:
        """``base`` (the eviction policy's key), with nodes of tenants over quota on ``tier`` first."""
        if not any(tier in q for q in self.quotas.values()):
            return base
        return lambda nd: (not self.over(self.tenant_of(nd), tier), *base(nd))

    def check_integrity(self, nodes: list[TreeNode]) -> None:
        """Raise AssertionError unless the L1 / L2 counts equal what ``nodes`` (the tree's) hold."""
        want: dict[tuple[int, ...] | None, dict[str, int]] = {}
        for nd in nodes:
            c = want.setdefault(self.salt_of(nd), {"device": 0, "host": 0})
            n = len(nd.key) // self.page_size
            c["device"] += n if nd.device_pages is not None else 0
            c["host"] += n if nd.host_pages is not None else 0
        for tags in set(want) | set(self.by_salt):
            got = self.by_salt.get(tags, {})
            exp = want.get(tags, {})
            for tier in ("device", "host"):
                assert got.get(tier, 0) == exp.get(tier, 0), (
                    f"tenant ledger: salt {tags} holds {exp.get(tier, 0)} {tier} pages, counted {got.get(tier, 0)}")
        per_tenant: dict[str | None, dict[str, int]] = {}
        for tags, counts in self.by_salt.items():
            t = per_tenant.setdefault(self.owner_of(tags), dict.fromkeys(TIERS, 0))
            for tier in TIERS:
                t[tier] += counts[tier]
        for tenant in set(per_tenant) | set(self.by_tenant):
            assert per_tenant.get(tenant, dict.fromkeys(TIERS, 0)) == self.by_tenant.get(
                tenant, dict.fromkeys(TIERS, 0)), f"tenant ledger: tenant {tenant!r} totals disagree with its salts"
