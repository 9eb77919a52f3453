"""The server-wide pin budget (serving/cache/kv_control.py), on the engine itself: the distinct L2 pages
pinned by all tenants' leases together stay at or under ``max_pinned_l2_fraction`` of L2 (half by
default), so pins of a few tenants cannot fill L2 and starve the pages staged through it (L1 -> L2 ->
L3 write-back, L3 loads, backups): the soak's two tenants without quotas each pinned half of L2 and
together all of it (issue 42, finding 6's soak). Past the budget an explicit pin is a 409 naming the
server-wide budget (not the tenant's quota), a breakpoint first lets the same tenant's older
breakpoints give way (never another tenant's) or is not pinned with that reason, and an idle
session's lease is not made. check_integrity() holds, and asserts the budget, after every step."""

from __future__ import annotations

import pytest

from harness.model_utils import tiny_model
from serving.cache.kv_control import ControlError, ControlLimits, KVControl
from serving.engine import Engine
from serving.server.config import ServerConfig

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
DAY = 86400.0
HALF = 32  # pages: half of the 64-page L2, the default budget
BUDGET = f"server-wide pin budget of {HALF}"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(model_path=str(tiny_model(tmp_path_factory.mktemp("budget"))), page_size=4,
                 max_total_tokens=256, hicache_ratio=1.0)  # L1 and L2: 64 pages each
    yield eng
    eng.shutdown()


@pytest.fixture
def ctl(engine):
    control = KVControl(engine.core)
    yield control
    control.call("advance_clock", {"seconds": DAY}, None)  # every lease ends: the next test starts clean
    assert not control.leases and not engine.core.tree.pins.held()


def prompt(seed: int, n: int = 64) -> list[int]:
    return [(seed * 89 + 11 * i) % 470 + 25 for i in range(n)]


def pinned(ctl: KVControl) -> int:
    """Distinct L2 pages the leases hold, counted here from the leases themselves."""
    return len({p for lease in ctl.leases.values() for p in lease.pages})


def sound(engine, ctl: KVControl) -> None:
    ctl.check_integrity()
    engine.check_integrity()
    assert pinned(ctl) <= HALF, f"{pinned(ctl)} L2 pages pinned, over half of L2"


def pin(engine, ctl: KVControl, ids: list[int], tenant: str) -> dict:
    engine.generate(input_ids=ids, sampling_params=GREEDY)
    try:
        return ctl.call("pin", {"input_ids": ids, "ttl_s": 600}, tenant)
    finally:
        sound(engine, ctl)


def breakpoint(engine, ctl: KVControl, ids: list[int], tenant: str) -> dict:
    engine.generate(input_ids=ids, sampling_params=GREEDY)
    out = ctl.call("cache_control", {"input_ids": ids, "ends": [len(ids)], "ttls": [3600.0], "read": 0}, tenant)
    sound(engine, ctl)
    return out


def on_l2(engine, ids: list[int]) -> bool:
    """Every whole page of ``ids`` has an L2 copy."""
    nodes = list(engine.core.tree.walk(ids, len(ids) // 4 * 4))
    return bool(nodes) and all(node.host_pages is not None for node, _pos, _m in nodes)


def test_two_tenants_share_one_budget_and_l2_keeps_room(engine, ctl):
    """alice and bob (no quotas: each may pin half of L2) take turns pinning 8-page prompts: together
    they stop at the budget, half of L2, and the other half still takes a backup."""
    for i, tenant in enumerate(["alice", "bob"] * 2):
        assert pin(engine, ctl, prompt(i, 32), tenant)["pinned_tokens"] == 32
    assert ctl.pinned_pages_of("alice") == ctl.pinned_pages_of("bob") == 16 and pinned(ctl) == HALF
    with pytest.raises(ControlError) as err:  # bob is under his own quota, the server is not
        pin(engine, ctl, prompt(10, 32), "bob")
    msg = str(err.value)
    assert err.value.status == 409 and BUDGET in msg and "max_pinned_l2_fraction 0.5" in msg, msg
    assert "pin quota" not in msg, msg  # the server's budget, not the tenant's quota
    assert ctl.pin_quota("alice") == ctl.pin_quota("bob") == HALF == ctl.pin_budget() == ctl.server_pinned_pages
    assert ctl.pin_limit("alice") == ctl.pin_limit("bob") == 16  # what the budget leaves each of them
    out = breakpoint(engine, ctl, prompt(11, 32), "bob")  # bob has no breakpoint that could give way
    # not pinned; created all the same: what the request wrote into the cache (Anthropic usage)
    assert out["created_tokens"] == 32 and out["pinned_tokens"] == 0 and out["released_breakpoints"] == 0, out
    [miss] = out["not_pinned"]
    assert BUDGET in miss["reason"] and "could not make room" in miss["reason"], miss
    assert pinned(ctl) == HALF and len(ctl.leases) == 4

    # L2 keeps room: a new prompt on L1 is backed up to L2 (evicting unpinned copies), pinned pages stay
    fresh = prompt(12)
    engine.generate(input_ids=fresh, sampling_params=GREEDY)
    engine.core.tree.backup_prefix(fresh)
    engine.core.req_cache.flush_transfers()
    assert on_l2(engine, fresh)
    sound(engine, ctl)
    # and once alice releases a lease, bob's pin fits (its backup finds L2 room too)
    ctl.call("unpin", {"lease_id": next(x.lease_id for x in ctl.leases.values() if x.tenant == "alice")}, "alice")
    assert pin(engine, ctl, prompt(10, 32), "bob")["pinned_tokens"] == 32
    assert ctl.pinned_pages_of("bob") == 24 and pinned(ctl) == ctl.server_pinned_pages == HALF


def test_a_breakpoint_makes_room_among_its_own_tenants_only(engine, ctl):
    a1, a2, b1, b2 = prompt(20), prompt(21), prompt(22), prompt(23)  # 16 pages each
    assert breakpoint(engine, ctl, a1, "alice")["created_tokens"] == 64
    assert pin(engine, ctl, b1, "bob")["pinned_tokens"] == 64  # the budget is full: 16 + 16
    # alice's next breakpoint is within her quota (16 + 16) but past the budget: her older one gives way
    out = breakpoint(engine, ctl, a2, "alice")
    assert out["created_tokens"] == 64 and out["released_breakpoints"] == 1 and not out["not_pinned"], out
    assert {x.input_ids[0] for x in ctl.leases.values()} == {a2[0], b1[0]}  # a1's lease gave way, bob's stayed
    # bob's breakpoint: only his explicit pin could make room, and explicit pins never give way
    out = breakpoint(engine, ctl, b2, "bob")
    assert out["created_tokens"] == 64 and out["pinned_tokens"] == 0 and out["released_breakpoints"] == 0, out
    assert BUDGET in out["not_pinned"][0]["reason"], out
    assert len(ctl.leases) == 2 and pinned(ctl) == ctl.server_pinned_pages == HALF  # alice's breakpoint stays


def test_idle_session_leases_are_not_made_past_the_budget(engine, ctl):
    sid = engine.core.open_session(ctl.retention.open_session("s1", "bob", {"demote_on_idle": True}))
    try:
        for seed in (30, 31):
            pin(engine, ctl, prompt(seed), "alice")  # alice holds the whole budget
        engine.generate(input_ids=prompt(32, 32), sampling_params=GREEDY, session_id=sid)
        ctl.retention.session_idle(sid)
        assert sid not in ctl.idle_lease and len(ctl.leases) == 2  # not made; nothing refused, nothing raised
        sound(engine, ctl)
        for lease in [x.lease_id for x in ctl.leases.values()]:
            ctl.call("unpin", {"lease_id": lease}, "alice")
        ctl.retention.session_idle(sid)  # room now: its KV is kept on L2 while it is idle
        assert sid in ctl.idle_lease and ctl.leases[ctl.idle_lease[sid]].tenant == "bob"
        sound(engine, ctl)
    finally:
        ctl.retention.close_session(sid)
        engine.core.close_session(sid)


def test_a_tenant_quota_under_the_budget_still_binds(engine, ctl):
    """A tenant's own limit is the smaller of its quota and what the budget leaves; each refusal names its bound."""
    engine.core.set_quotas({"q": {"host": 8}})
    try:
        assert ctl.pin_limit("q") == 8
        with pytest.raises(ControlError) as err:
            pin(engine, ctl, prompt(40), "q")  # 16 pages > its 8-page quota
        assert err.value.status == 409 and "8-page pin quota" in str(err.value)
        assert "server-wide" not in str(err.value)
        pin(engine, ctl, prompt(41), "alice")
        pin(engine, ctl, prompt(42, 40), "bob")  # 16 + 10 of the 32
        assert ctl.pin_limit("q") == 6  # what the budget leaves, under its quota
        with pytest.raises(ControlError, match=BUDGET):
            pin(engine, ctl, prompt(43, 32), "q")  # 8 pages: within its quota, past the budget
    finally:
        engine.core.set_quotas({})


def test_check_integrity_asserts_the_budget(engine, ctl):
    pin(engine, ctl, prompt(50), "alice")  # 16 pages
    ctl.limits = ControlLimits(max_pinned_l2_fraction=0.125)  # an 8-page budget: 16 are over it
    with pytest.raises(AssertionError, match="over the server-wide pin budget of 8"):
        ctl.check_integrity()
    ctl.limits = ControlLimits()
    page = next(iter(ctl._all_pinned))
    ctl._all_pinned[page] += 1  # a lease that does not exist
    with pytest.raises(AssertionError, match="the server's pinned pages disagree"):
        ctl.check_integrity()
    ctl._all_pinned[page] -= 1
    sound(engine, ctl)


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.01, 2, True, "0.5"])
def test_the_fraction_is_validated(bad):
    with pytest.raises(ValueError, match="max_pinned_l2_fraction must be in"):
        ControlLimits(max_pinned_l2_fraction=bad)
    if not isinstance(bad, str | bool):
        with pytest.raises(ValueError, match="max_pinned_l2_fraction must be in"):
            ServerConfig(max_pinned_l2_fraction=bad)
    assert ControlLimits(max_pinned_l2_fraction=1).max_pinned_l2_fraction == 1
    assert ServerConfig().engine_process().max_pinned_l2_fraction == 0.5  # passed on to the engine
