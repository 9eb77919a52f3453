"""serving/cache/kv_control.py's bookkeeping on the engine itself: pins of one prefix count its pages
once against the tenant's pin quota, release and expiry give them back, and check_integrity()
notices per-page, per-lease and session accounting that disagrees with the leases / the engine."""

from __future__ import annotations

import time

import pytest

from harness.model_utils import tiny_model
from serving.cache.kv_control import ControlError, ControlLimits, KVControl
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
IDS = list(range(10, 42))  # 8 pages of 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(model_path=str(tiny_model(tmp_path_factory.mktemp("acct"))), page_size=4,
                 max_total_tokens=256, hicache_ratio=2.0)
    eng.generate(input_ids=IDS, sampling_params=GREEDY)
    yield eng
    eng.shutdown()


def control(engine, **limits) -> KVControl:
    engine.core.set_quotas({"t": {"host": 10}})
    return KVControl(engine.core, ControlLimits(**limits))


def test_a_prefix_pinned_many_times_counts_once(engine):
    ctl = control(engine, max_pin_leases_per_tenant=4)
    leases = [ctl.call("pin", {"input_ids": IDS, "ttl_s": 60}, "t")["lease_id"] for _ in range(4)]
    assert ctl.pinned_pages == 8  # 4 leases x 8 pages, within the 10-page quota
    with pytest.raises(ControlError, match="max_pin_leases_per_tenant 4") as err:
        ctl.call("pin", {"input_ids": IDS, "ttl_s": 60}, "t")
    assert err.value.status == 429
    ctl.check_integrity()
    for lease in leases[:3]:
        ctl.call("unpin", {"lease_id": lease}, "t")
    assert ctl.pinned_pages == 8  # the last lease still holds them
    ctl.expire(now=float("inf"))
    assert ctl.pinned_pages == 0 and not ctl.leases
    assert not engine.core.tree.pins.held()  # every tree pin released
    ctl.check_integrity()


def test_check_integrity_notices_broken_accounting(engine):
    ctl = control(engine)
    ctl.call("pin", {"input_ids": IDS, "ttl_s": 60}, "t")
    ctl.check_integrity()
    page = next(iter(ctl._pinned["t"]))
    del ctl._pinned["t"][page]  # a page the tenant's lease holds, not counted against it
    with pytest.raises(AssertionError, match="per-tenant pinned pages disagree"):
        ctl.check_integrity()
    ctl._pinned["t"][page] = 1
    ctl._lease_count["t"] += 1
    with pytest.raises(AssertionError, match="per-tenant lease counts disagree"):
        ctl.check_integrity()
    ctl._lease_count["t"] -= 1
    ctl.check_integrity()
    sid = engine.core.open_session(ctl.retention.open_session(None, "t", None))
    ctl.check_integrity()
    ctl.sessions.close(sid)  # the engine still has it open
    with pytest.raises(AssertionError, match="sessions open in the engine but not registered"):
        ctl.check_integrity()
    engine.core.close_session(sid)
    ctl.release_all()
    ctl.check_integrity()


def test_sessions_are_unique_and_capped(engine):
    ctl = control(engine, max_sessions=3, max_sessions_per_tenant=2)
    for sid, tenant in (("a", "t"), ("b", "t"), ("c", None)):
        engine.core.open_session(ctl.retention.open_session(sid, tenant, None))
    for sid, tenant, status, text in (("a", "t", 409, "already open"),
                                      ("d", "t", 429, "max_sessions 3"), ("d", None, 429, "max_sessions 3")):
        with pytest.raises(ControlError, match=text) as err:
            ctl.retention.open_session(sid, tenant, None)
        assert err.value.status == status
    ctl.retention.close_session("c")
    engine.core.close_session("c")
    with pytest.raises(ControlError, match="max_sessions_per_tenant 2"):
        ctl.retention.open_session("d", "t", None)
    engine.core.open_session(ctl.retention.open_session("d", "u", None))
    with pytest.raises(ValueError, match="already open"):  # the offline engine refuses an open id too
        engine.core.open_session("d")
    ctl.check_integrity()
    for sid in ("a", "b", "d"):
        ctl.retention.close_session(sid)
        engine.core.close_session(sid)
    ctl.check_integrity()


def test_session_liveness_has_one_owner_each(engine):
    """Which sessions are open is the tree's (``EngineCore.sessions`` is ``tree.sessions``); when each
    was last used, and so when it idles out, is the KV control's registry (issue 28: the engine loop
    kept its own times beside them)."""
    ctl = control(engine)
    assert engine.core.sessions is engine.core.tree.sessions
    short = engine.core.open_session(ctl.retention.open_session(None, None, {"ttl_s": 1e-3}))
    long = engine.core.open_session(ctl.retention.open_session(None, None, None))
    assert short in engine.core.tree.sessions and set(ctl.sessions.used) == {short, long}
    ctl.check_integrity()
    used = ctl.sessions.used[short]
    while time.monotonic() <= used + 1e-3:  # past its ttl_s (a bound, not a timed assertion)
        pass
    assert ctl.retention.idle_sessions({short}, 600.0) == []  # a session with a live request is not idle
    assert [sid for sid, _ in ctl.retention.idle_sessions(set(), 600.0)] == [short]  # its ttl_s, else the default
    ctl.retention.session_idle(short)  # its last request finished: its idle time starts again
    assert ctl.sessions.used[short] > used
    for sid in (short, long):
        engine.core.close_session(sid)
        ctl.retention.close_session(sid)
    assert short not in engine.core.tree.sessions and not ctl.sessions.used
    ctl.check_integrity()
