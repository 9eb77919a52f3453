"""An Engine gives its memory back at shutdown, and L2 grows while the engine serves.

- Create, shut down and re-create an Engine in one process: the second gets the same L1 and L2
  capacity, and the first one's big tensors (L1's KV buffer, L2's buffer, the weights) are freed
  by ``shutdown()`` itself (weak references die; the test never collects garbage on its own).
- L2 pinned in the background (hicache.tiers.host_pinning), held on CPU by
  HICACHE_TEST_HOLD_L2_PIN: the engine serves with the first chunk's pages, and the rest join L2
  once pinned; the cache's invariants hold throughout, and a shutdown mid-pinning stops it.
"""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from harness.model_utils import tiny_model
from hicache.tiers.host import GrowingPageAllocator
from hicache.tiers.host_pinning import HOLD_ENV
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(40 + 8 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("restart"))


def _engine(path, **kw) -> Engine:
    # on the CPU on any host: a GPU host sizes L1 from the free device memory, which the CUDA
    # context and caches move a little between engines (tests/engine/test_gpu.py has its restart)
    return Engine(model_path=str(path), device="cpu", page_size=4, grammar_backend="none", **kw)


def test_second_engine_gets_the_same_capacity_and_the_first_is_freed(model):
    gc.disable()  # the shutdown must free what it holds, not a collection the test runs
    try:
        first = _engine(model, hicache_ratio=2.0)
        capacity = (first.core.runner.pool.num_pages, first.core.host_pool.num_pages)
        out1 = first.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        big = [first.core.runner.pool.kv_buffer, first.core.host_pool.buffer,
               next(first.core.runner.model.parameters())]
        refs = [weakref.ref(t) for t in big]
        del big
        first.shutdown()
        assert [r() is None for r in refs] == [True, True, True], "the first engine's tensors outlived shutdown()"
        second = _engine(model, hicache_ratio=2.0)
        assert (second.core.runner.pool.num_pages, second.core.host_pool.num_pages) == capacity
        out2 = second.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in out2] == [o["output_ids"] for o in out1]
        second.check_integrity()
        second.shutdown()
    finally:
        gc.enable()


def test_l2_grows_while_the_engine_serves(model, tmp_path, monkeypatch):
    hold = tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv(HOLD_ENV, str(hold))
    eng = _engine(model, hicache_size=0.25, max_total_tokens=256)  # 4 chunks of 64 MiB: 1 pinned at once
    host = eng.core.host_pool
    assert isinstance(host.allocator, GrowingPageAllocator) and host.growing
    first = host.allocator.available
    assert 0 < first < host.num_pages
    out = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)  # L1 holds 256 tokens: pages go to L2
    eng.check_integrity()
    assert host.allocator.available == first and host.allocator.num_used > 0  # held: L2 did not grow
    hold.unlink()
    deadline = time.monotonic() + 60
    while not host.pinner.done:
        assert time.monotonic() < deadline, "the background pinning did not finish"
        time.sleep(0.01)
    again = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)  # its first step takes the pinned pages
    assert host.allocator.available == host.num_pages and not host.growing
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]
    assert sum(o["meta_info"]["cached_tokens"] for o in again) > 0
    eng.check_integrity()
    eng.shutdown()


def test_shutdown_while_l2_is_still_pinning(model, tmp_path, monkeypatch):
    hold = tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv(HOLD_ENV, str(hold))
    eng = _engine(model, hicache_size=0.25, max_total_tokens=256)
    pinner = eng.core.host_pool.pinner
    eng.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY)
    eng.shutdown()  # the pinning threads wait on the hold: shutdown stops them instead of waiting
    assert not pinner.done and not any(t.is_alive() for t in pinner._threads)
