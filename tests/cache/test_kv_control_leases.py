"""Pin leases in serving/cache/kv_control.py, on the engine itself: a lease whose time is up is gone for
every call, even when the loop has not run its periodic sweep yet (a stalled or busy loop)."""

from __future__ import annotations

import time
import types
import typing

import pytest

from harness.model_utils import tiny_model
from serving.cache.control_core import ControlCore, RequestQueues
from serving.cache.kv_control import ControlError, KVControl
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(model_path=str(tiny_model(tmp_path_factory.mktemp("leases"))), page_size=4,
                 max_total_tokens=256, hicache_ratio=2.0)
    yield eng
    eng.shutdown()


def test_an_ended_lease_is_gone_before_the_sweep(engine):
    ctl = KVControl(engine.core)
    ids = list(range(10, 42))
    engine.generate(input_ids=ids, sampling_params=GREEDY)
    lease = ctl.call("pin", {"input_ids": ids, "ttl_s": 0.05}, None)
    assert lease["pinned_tokens"] == 32 and ctl.pinned_pages == 8
    time.sleep(0.1)  # the lease ends; nothing calls expire() (the loop's sweep) meanwhile
    with pytest.raises(ControlError, match="unknown or expired lease") as err:
        ctl.call("unpin", {"lease_id": lease["lease_id"]}, None)
    assert err.value.status == 404
    assert ctl.pinned_pages == 0  # its pages are no longer held against the pin limit
    ctl.check_integrity()
    engine.check_integrity()


@pytest.mark.parametrize("proto", [ControlCore, RequestQueues])
def test_the_engine_is_what_the_control_api_reads(engine, proto):
    """serving/cache/control_core.py's protocols name members the real engine has, of their types."""
    obj = engine.core if proto is ControlCore else engine.core.scheduler
    hints = typing.get_type_hints(proto)
    assert hints
    for name, want in hints.items():
        got = getattr(obj, name)  # AttributeError: the engine lost a member the control API reads
        union = typing.get_origin(want) in (typing.Union, types.UnionType)
        kinds = tuple(typing.get_origin(k) or k for k in (typing.get_args(want) if union else (want,))
                      if k is not type(None))
        if all(isinstance(k, type) and not getattr(k, "_is_protocol", False) for k in kinds):
            assert got is None or isinstance(got, kinds), (name, type(got), want)
