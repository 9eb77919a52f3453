"""cache_control breakpoints on the engine itself (serving/cache/kv_breakpoints.py): a prefix sent again
refreshes its lease instead of pinning it twice; the per-tenant pinned-pages limit is a 429 before any
work; a TTL's end (the lease clock moved on) releases the pages; the integrity checks hold."""

from __future__ import annotations

import pytest

from harness.model_utils import tiny_model
from serving.cache.kv_control import ControlError, KVControl
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(model_path=str(tiny_model(tmp_path_factory.mktemp("bps"))), page_size=4,
                 max_total_tokens=256, hicache_ratio=1.0)
    yield eng
    eng.shutdown()


def test_refresh_limit_and_expiry(engine):
    ctl = KVControl(engine.core)
    ids = list(range(10, 50))  # 40 tokens: 10 pages
    engine.generate(input_ids=ids, sampling_params=GREEDY)
    first = ctl.call("cache_control", {"input_ids": ids, "ends": [20, 40], "ttls": [300.0, 300.0], "read": 0}, None)
    assert first["created_tokens"] == 40 and first["pinned_tokens"] == 40 and first["tenant_pinned_pages"] == 10
    assert len(ctl.leases) == 2
    ctl.call("advance_clock", {"seconds": 200.0}, None)
    again = ctl.call("cache_control", {"input_ids": ids, "ends": [40], "ttls": [300.0], "read": 40}, None)
    assert again["created_tokens"] == 0 and again["refreshed_tokens"] == 40 and len(ctl.leases) == 2
    assert ctl.call("cache_control_admit", {"input_ids": ids, "ends": [40]}, None) == {"new_pages": 0}
    limit = ctl.pin_limit(None)  # half of L2 for the default tenant
    long_ids = list(range(100, 100 + 4 * (limit + 1)))
    with pytest.raises(ControlError, match="pinned pages") as err:
        ctl.call("cache_control_admit", {"input_ids": long_ids, "ends": [len(long_ids)]}, None)
    assert err.value.status == 429
    ctl.check_integrity()
    ctl.call("advance_clock", {"seconds": 150.0}, None)
    assert len(ctl.leases) == 2  # 350 s after they were made, but refreshed by the hit at 200 s
    ctl.call("advance_clock", {"seconds": 151.0}, None)
    assert not ctl.leases and ctl.pinned_pages == 0
    after = ctl.call("cache_control", {"input_ids": ids, "ends": [40], "ttls": [300.0], "read": 0}, None)
    assert after["created_tokens"] == 40 and len(ctl.leases) == 1  # pinned afresh (its KV was still cached)
    with pytest.raises(ControlError, match="seconds"):
        ctl.call("advance_clock", {"seconds": -1}, None)
    ctl.check_integrity()
    engine.check_integrity()


def test_without_l2_breakpoints_pin_nothing_and_fail_nothing(tmp_path):
    """Agent clients send cache_control on every request: a server without L2 accepts them."""
    eng = Engine(model_path=str(tiny_model(tmp_path)), page_size=4, max_total_tokens=256)
    try:
        ctl = KVControl(eng.core)
        ids = list(range(10, 50))
        eng.generate(input_ids=ids, sampling_params=GREEDY)
        assert ctl.call("cache_control_admit", {"input_ids": ids, "ends": [40]}, None)["pinning"] is False
        out = ctl.call("cache_control", {"input_ids": ids, "ends": [40], "ttls": [300.0], "read": 36}, None)
        assert out["created_tokens"] == 0 and out["pinned_tokens"] == 0 and out["not_pinned"], out
        assert not ctl.leases
        ctl.check_integrity()
    finally:
        eng.shutdown()
