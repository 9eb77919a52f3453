"""cache_control breakpoints on the engine itself (serving/cache/kv_breakpoints.py): a prefix sent again
refreshes its lease instead of pinning it twice; a TTL's end (the lease clock moved on) releases the
pages. Best-effort (issue 42, finding 6): a breakpoint past the tenant's pin quota or a lease cap makes
room by releasing the same tenant's least recently used breakpoints -- never an explicit /cache/pin
lease, never another tenant's -- and one that cannot be pinned is reported with its reason, never
refused. A flush keeps every lease and breakpoint, on L2 (finding 4). The integrity checks hold after
every step."""

from __future__ import annotations

import pytest

from harness.model_utils import tiny_model
from serving.cache.kv_control import ControlError, ControlLimits, KVControl
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
DAY = 86400.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(model_path=str(tiny_model(tmp_path_factory.mktemp("bps"))), page_size=4,
                 max_total_tokens=256, hicache_ratio=1.0)
    yield eng
    eng.shutdown()


def prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 97 + 13 * i) % 480 + 20 for i in range(n)]


def sound(engine, ctl: KVControl) -> None:
    ctl.check_integrity()
    engine.check_integrity()


def breakpoint(engine, ctl: KVControl, ids: list[int], tenant: str | None = None, ttl: float = 300.0) -> dict:
    """The request runs, then its breakpoint (the whole prompt) is applied, as the HTTP side does."""
    engine.generate(input_ids=ids, sampling_params=GREEDY)
    out = ctl.call("cache_control", {"input_ids": ids, "ends": [len(ids)], "ttls": [ttl], "read": 0}, tenant)
    sound(engine, ctl)
    return out


def lease_of(ctl: KVControl, ids: list[int], tenant: str | None = None) -> str | None:
    return next((p.lease_id for (n, _), p in ctl.breakpoints.points.get(tenant, {}).items()
                 if n == len(ids) // 4 * 4 and p.lease_id in ctl.leases and
                 ctl.leases[p.lease_id].input_ids == ids[:n]), None)


def end_all(ctl: KVControl) -> None:
    ctl.call("advance_clock", {"seconds": DAY}, None)
    assert not ctl.leases and ctl.pinned_pages == 0


def test_refresh_and_expiry(engine):
    ctl = KVControl(engine.core)
    ids = list(range(10, 50))  # 40 tokens: 10 pages
    engine.generate(input_ids=ids, sampling_params=GREEDY)
    first = ctl.call("cache_control", {"input_ids": ids, "ends": [20, 40], "ttls": [300.0, 3600.0], "read": 0}, None)
    assert first["created_tokens"] == 40 and first["pinned_tokens"] == 40 and first["tenant_pinned_pages"] == 10
    assert first["created_by_ttl"] == [(3600.0, 40)], first  # both segments held by the 1 h lease
    assert len(ctl.leases) == 2 and not first["not_pinned"] and first["released_breakpoints"] == 0
    ctl.call("advance_clock", {"seconds": 200.0}, None)
    again = ctl.call("cache_control", {"input_ids": ids, "ends": [40], "ttls": [300.0], "read": 40}, None)
    assert again["created_tokens"] == 0 and again["refreshed_tokens"] == 40 and len(ctl.leases) == 2
    sound(engine, ctl)
    ctl.call("advance_clock", {"seconds": 299.0}, None)
    assert len(ctl.leases) == 2  # 499 s after they were made, but refreshed by the hit at 200 s
    ctl.call("advance_clock", {"seconds": 2.0}, None)
    assert len(ctl.leases) == 1  # the 5-minute one ended; the hour's lives on
    ctl.call("advance_clock", {"seconds": 3100.0}, None)
    assert not ctl.leases and ctl.pinned_pages == 0
    after = ctl.call("cache_control", {"input_ids": ids, "ends": [40], "ttls": [300.0], "read": 0}, None)
    assert after["created_tokens"] == 40 and len(ctl.leases) == 1  # pinned afresh (its KV was still cached)
    with pytest.raises(ControlError, match="seconds"):
        ctl.call("advance_clock", {"seconds": -1}, None)
    sound(engine, ctl)
    end_all(ctl)


def test_older_breakpoints_of_the_tenant_give_way(engine):
    """The default tenant's pin quota is half of L2 (32 pages here): 3 breakpoints of 10 pages fit, the
    4th releases the least recently used one; explicit pins and another tenant's breakpoints stay. (The
    server-wide pin budget is all of L2 here, so only the tenant's quota binds.)"""
    ctl = KVControl(engine.core, ControlLimits(max_pinned_l2_fraction=1.0))
    assert ctl.pin_limit(None) == 32
    a, b, c, d, e = (prompt(s) for s in range(1, 6))
    for ids in (a, b, c):
        assert breakpoint(engine, ctl, ids)["created_tokens"] == 40
    other = breakpoint(engine, ctl, prompt(9), tenant="bob")  # another tenant's: its own quota
    assert other["created_tokens"] == 40
    ctl.call("advance_clock", {"seconds": 10.0}, None)
    assert breakpoint(engine, ctl, a)["refreshed_tokens"] == 40  # a is used again: b is now the oldest
    out = breakpoint(engine, ctl, d)  # 30 + 10 > 32: b gives way
    assert out["created_tokens"] == 40 and out["released_breakpoints"] == 1 and not out["not_pinned"], out
    assert lease_of(ctl, b) is None and lease_of(ctl, a) and lease_of(ctl, c) and lease_of(ctl, d)
    assert out["tenant_pinned_pages"] == 30
    assert lease_of(ctl, prompt(9), "bob")  # never another tenant's

    # an explicit pin never gives way: with a pinned, c and d are the candidates (c the older)
    explicit = ctl.call("pin", {"input_ids": a, "ttl_s": 600}, None)
    assert explicit["pinned_tokens"] == 40
    ctl.call("advance_clock", {"seconds": 301.0}, None)  # the 5-minute breakpoints end; the pin stays
    assert list(ctl.leases) == [explicit["lease_id"]]
    for ids in (c, d):
        assert breakpoint(engine, ctl, ids)["created_tokens"] == 40
    out = breakpoint(engine, ctl, e)
    assert out["released_breakpoints"] == 1 and lease_of(ctl, c) is None and lease_of(ctl, d)
    assert explicit["lease_id"] in ctl.leases

    sound(engine, ctl)
    end_all(ctl)

    # a breakpoint that does not fit even if every other breakpoint gave way: reported, nothing released
    assert engine.core.flush_cache()  # an empty tree: L2 has room for every backup below
    engine.core.set_quotas({"q": {"host": 12}})  # tenant q pins at most 12 pages
    p1, p2, p3 = prompt(21, 16), prompt(22, 16), prompt(23, 36)  # 4, 4 and 9 pages
    engine.generate(input_ids=p1, sampling_params=GREEDY)
    assert ctl.call("pin", {"input_ids": p1, "ttl_s": 600}, "q")["pinned_tokens"] == 16
    assert breakpoint(engine, ctl, p2, tenant="q")["created_tokens"] == 16
    out = breakpoint(engine, ctl, p3, tenant="q")  # 8 + 9 > 12, and 4 + 9 > 12 without p2: not pinned
    # not pinned, but written into the cache all the same: created (Anthropic's cache_creation_input_tokens)
    assert out["created_tokens"] == 36 and out["released_breakpoints"] == 0 and out["pinned_tokens"] == 0, out
    [miss] = out["not_pinned"]
    assert miss["tokens"] == 36 and "12-page pin quota" in miss["reason"], miss
    assert "could not make room" in miss["reason"], miss
    assert lease_of(ctl, p2, "q")  # kept
    # /cache/pin keeps its refusal (409 past the quota; 429 past a lease cap)
    with pytest.raises(ControlError, match="12-page pin quota") as err:
        ctl.call("pin", {"input_ids": p3, "ttl_s": 600}, "q")
    assert err.value.status == 409
    sound(engine, ctl)
    end_all(ctl)


def test_a_lease_cap_makes_older_breakpoints_give_way(engine):
    ctl = KVControl(engine.core, ControlLimits(max_pin_leases=3, max_pin_leases_per_tenant=2))
    x, y, z = (prompt(s, 12) for s in range(30, 33))  # 3 pages each: the caps bind, not the quota
    for ids in (x, y):
        assert breakpoint(engine, ctl, ids, tenant="alice")["created_tokens"] == 12
    out = breakpoint(engine, ctl, z, tenant="alice")  # her 3rd lease, her cap is 2: x gives way
    assert out["created_tokens"] == 12 and out["released_breakpoints"] == 1, out
    assert lease_of(ctl, x, "alice") is None and lease_of(ctl, y, "alice") and lease_of(ctl, z, "alice")
    assert breakpoint(engine, ctl, x, tenant="bob")["created_tokens"] == 12  # the server's 3rd lease
    out = breakpoint(engine, ctl, y, tenant="bob")  # over the server's cap of 3: only bob's own may give way
    assert out["released_breakpoints"] == 1 and lease_of(ctl, x, "bob") is None, out
    assert lease_of(ctl, y, "alice") and lease_of(ctl, z, "alice")  # alice's stay
    out = breakpoint(engine, ctl, z, tenant="carol")  # carol holds none: not pinned, said so (created: in the cache)
    assert out["created_tokens"] == 12 and out["pinned_tokens"] == 0 and out["released_breakpoints"] == 0, out
    assert "max_pin_leases 3" in out["not_pinned"][0]["reason"], out
    with pytest.raises(ControlError, match="max_pin_leases 3") as err:  # an explicit pin: 429
        ctl.call("pin", {"input_ids": z, "ttl_s": 60}, "carol")
    assert err.value.status == 429
    sound(engine, ctl)
    end_all(ctl)


def test_evicted_kv_is_reported_not_pinned(engine):
    """The request's KV is gone by the time its breakpoint is applied (other requests evicted it)."""
    ctl = KVControl(engine.core)
    gone = prompt(40, 40)
    out = ctl.call("cache_control", {"input_ids": gone, "ends": [40], "ttls": [300.0], "read": 0}, None)
    assert out["created_tokens"] == 0 and out["pinned_tokens"] == 0, out
    assert "nothing of this prompt is cached" in out["not_pinned"][0]["reason"], out
    sound(engine, ctl)


def test_pin_ttl_is_capped(engine):
    ctl = KVControl(engine.core, ControlLimits(max_pin_ttl_s=600.0))
    ids = prompt(50, 16)
    engine.generate(input_ids=ids, sampling_params=GREEDY)
    with pytest.raises(ControlError, match=r"max_pin_ttl_s") as err:
        ctl.call("pin", {"input_ids": ids, "ttl_s": 601}, None)
    assert err.value.status == 400 and "600" in str(err.value)
    assert ctl.call("pin", {"input_ids": ids, "ttl_s": 600}, None)["pinned_tokens"] == 16
    out = ctl.call("cache_control", {"input_ids": ids, "ends": [16], "ttls": [3600.0], "read": 0}, None)
    assert out["refreshed_tokens"] == 0 and out["pinned_tokens"] == 16  # its own lease: cut to 600 s
    ctl.call("advance_clock", {"seconds": 601.0}, None)
    assert not ctl.leases
    with pytest.raises(ValueError, match="max_pin_ttl_s"):
        ControlLimits(max_pin_ttl_s=DAY + 1)
    sound(engine, ctl)


def test_a_flush_keeps_leases_and_breakpoints(engine):
    ctl = KVControl(engine.core)
    core = engine.core
    pinned, bp, bystander = prompt(60), prompt(61), prompt(62)
    for ids in (pinned, bystander):
        engine.generate(input_ids=ids, sampling_params=GREEDY)
    lease = ctl.call("pin", {"input_ids": pinned, "ttl_s": 3600}, None)
    assert breakpoint(engine, ctl, bp, ttl=3600.0)["created_tokens"] == 40
    assert core.flush_cache(keep=ctl.held_pages())
    assert ctl.flushed() == {"kept_leases": 2, "kept_breakpoints": 1, "kept_pinned_pages": 20}
    sound(engine, ctl)
    assert core.tree.cached_pages("device") == 0 and core.tree.cached_pages("host") == 20
    for ids, on_l2 in ((pinned, 40), (bp, 40), (bystander, 0)):
        assert ctl.call("lookup", {"input_ids": ids}, None) == {"L1": 0, "L2": on_l2, "L3": 0, "prompt_tokens": 40}
    again = breakpoint(engine, ctl, bp)  # the breakpoint lives on: a hit refreshes it
    assert again["refreshed_tokens"] == 40 and again["created_tokens"] == 0
    assert ctl.call("unpin", {"lease_id": lease["lease_id"]}, None)["pinned_tokens"] == 40  # not "unknown"
    sound(engine, ctl)
    end_all(ctl)
    assert core.flush_cache(keep=ctl.held_pages())  # nothing held: everything goes
    assert core.tree.cached_pages("device") == 0 and core.tree.cached_pages("host") == 0
    sound(engine, ctl)


def test_without_l2_breakpoints_pin_nothing_and_fail_nothing(tmp_path):
    """Agent clients send cache_control on every request: a server without L2 accepts them."""
    eng = Engine(model_path=str(tiny_model(tmp_path)), page_size=4, max_total_tokens=256)
    try:
        ctl = KVControl(eng.core)
        ids = list(range(10, 50))
        eng.generate(input_ids=ids, sampling_params=GREEDY)
        out = ctl.call("cache_control", {"input_ids": ids, "ends": [40], "ttls": [300.0], "read": 36}, None)
        assert out["created_tokens"] == 4 and out["pinned_tokens"] == 0, out  # in L1 past the 36 read: created
        assert "no L2 tier" in out["not_pinned"][0]["reason"], out
        assert not ctl.leases
        ctl.check_integrity()
    finally:
        eng.shutdown()
