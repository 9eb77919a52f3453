"""The KV control's integrity check (``KVControl.check_integrity``, serving/cache/kv_control.py): its
pin counting recomputed from the leases themselves and compared, and every bound asserted.

Concurrency contract: the engine loop thread only, as a part of KVControl (it reads its state).
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def check_control(ctl: Any, by_tenant: dict[str | None, Counter[int]], every: Counter[int],
                  lease_count: Counter[str | None]) -> None:
    """Raise AssertionError unless every lease's pages are pinned in the tree (at least once per
    lease holding them); each tenant's pinned pages (counted once) and leases match its leases and
    stay within its pin quota and the lease caps; all leases' pages (counted once, whichever
    tenants' leases hold them) match the leases and stay within the server-wide pin budget;
    every idle-session lease exists; and the open sessions agree with the engine's
    (serving/cache/kv_sessions.py) and the breakpoints with the leases (kv_breakpoints.py).
    ``by_tenant``, ``every`` and ``lease_count`` are KVControl's pin counting (tenant -> L2 page ->
    its leases holding it; L2 page -> all leases holding it; tenant -> its leases)."""
    held: Counter[int] = Counter()
    per_tenant: dict[str | None, Counter[int]] = {}
    for lease in ctl.leases.values():
        held.update(lease.pages)
        per_tenant.setdefault(lease.tenant, Counter()).update(lease.pages)
    pins = ctl.tree.pins
    bad = [p for p, k in held.items() if pins.count(p) < k]
    assert not bad, f"KV control: leased L2 pages not pinned in the tree: {bad[:8]}"
    assert per_tenant == by_tenant, "KV control: per-tenant pinned pages disagree with the leases"
    over = [t for t, pages in per_tenant.items() if len(pages) > ctl.pin_quota(t)]
    assert not over, f"KV control: tenants over their pin quota: {over[:8]}"
    assert held == every, "KV control: the server's pinned pages disagree with the leases"
    assert not held or len(held) <= ctl.pin_budget(), \
        f"KV control: {len(held)} L2 pages pinned, over the server-wide pin budget of {ctl.pin_budget()}"
    counts = Counter(x.tenant for x in ctl.leases.values())
    assert counts == lease_count, "KV control: per-tenant lease counts disagree with the leases"
    assert len(ctl.leases) <= ctl.limits.max_pin_leases, f"KV control: {len(ctl.leases)} leases held"
    over = [t for t, k in counts.items() if t is not None and k > ctl.limits.max_pin_leases_per_tenant]
    assert not over, f"KV control: tenants over max_pin_leases_per_tenant: {over[:8]}"
    stray = [s for s, lid in ctl.idle_lease.items() if lid not in ctl.leases]
    assert not stray, f"KV control: idle sessions whose lease is gone: {stray[:8]}"
    ctl.sessions.check_integrity(ctl.core.sessions)
    ctl.breakpoints.check_integrity()
