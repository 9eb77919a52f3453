"""The KV namespace has one owner (``EngineCore.kv_namespace``): the cache events name a page by
the key L3 stores it under, with or without L3 and whatever the weights' --quantization (issue 28:
the events' own formula lacked the weights' tag, so a router computed other keys than L3's)."""

from __future__ import annotations

import dataclasses

import pytest

from harness.model_utils import tiny_model
from hicache.keys import page_keys
from serving.engine.core import EngineCore
from serving.engine.loop import EngineLoop
from serving.engine.offline import config_from_kwargs
from serving.server.config import ServerConfig

PS = 4
PROMPT = [(7 * i + 3) % 500 + 1 for i in range(4 * PS + 1)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("events-ns"))


def events_of(path, db, quantization: str) -> tuple[str, list[str], str | None]:
    """(the events' namespace, the keys of the L1 pages they announce, L3's namespace or None)."""
    l3 = {} if db is None else {"hicache_storage_backend": "lmdb", "hicache_storage_backend_extra_config":
                                {"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1}}
    core = EngineCore(config_from_kwargs(model_path=str(path), page_size=PS, max_total_tokens=256,
                                         hicache_ratio=2.0, quantization=quantization, **l3))
    settings = dataclasses.replace(ServerConfig().engine_process(), enable_cache_events=True)
    try:
        loop = EngineLoop(core, None, None, settings)  # type: ignore[arg-type]  # no pipes: nothing is sent
        req = core.make_request(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 1})
        core.add(req)
        while core.scheduler.has_work:
            core.step()
        keys = [k for _, op, tier, ks in loop.events.events if op == "add" and tier == "L1" for k in ks]
        return loop.events.namespace, keys, None if core.storage is None else core.storage.writeback.namespace
    finally:
        core.shutdown(persist=False)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_events_and_l3_agree_on_the_namespace(tiny, tmp_path, quantization):
    with_ns, with_keys, l3_ns = events_of(tiny, tmp_path / "l3", quantization)
    without_ns, without_keys, _ = events_of(tiny, None, quantization)
    assert with_ns == l3_ns == without_ns, (with_ns, l3_ns, without_ns)
    assert ("|q:int8" in l3_ns) == (quantization == "int8")
    full = len(PROMPT) // PS * PS
    assert set(with_keys) == set(without_keys) == set(page_keys(PROMPT[:full], PS, l3_ns))
