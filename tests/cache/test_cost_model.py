"""The L3 load-vs-recompute cost model: its arithmetic, and its decisions on a real engine
(SmolLM2, fp32, CPU) with a throttled store and a fast one; a fetch that falls behind recompute is cut."""

from __future__ import annotations

import random
import threading

import pytest

from harness.model_utils import smollm2_path
from harness.slow_storage import slow_lmdb  # noqa: F401 - fixture
from serving.cache.cost_model import CostModel, make_load_policy, prefill_backlog
from serving.cache.prefetch_policy import MIN_CUT_S, LoadBudget
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


def test_line_fit_and_decisions():
    cm = CostModel(page_bytes=1_000_000, page_size=16, explore_every=4)
    d = cm.decide(10)
    assert d.load and "not measured" in d.reason  # nothing known: load, to learn
    cm.observe_prefill(1600, 1.0)  # 1600 tok/s: 10 pages = 0.1 s to recompute
    for pages in (4, 16, 64):  # 5 ms fixed + 1 GB/s
        cm.observe_read(pages * 1_000_000, 0.005 + pages * 1e-3)
    load_s, recompute_s = cm.estimate(10)
    assert load_s == pytest.approx(0.015, rel=0.05) and recompute_s == pytest.approx(0.1)
    assert cm.decide(10).load
    st = cm.stats()
    assert st["cost_l3_read_gbps"] == pytest.approx(1.0, rel=0.05)
    assert st["cost_l3_fixed_ms"] == pytest.approx(5, rel=0.1)
    slow = CostModel(page_bytes=1_000_000, page_size=16, explore_every=4)
    slow.observe_prefill(1600, 1.0)
    slow.observe_read(10_000_000, 1.0)  # 10 MB/s: 10 pages = 1 s to load
    decisions = [slow.decide(10) for _ in range(8)]
    assert [d.load for d in decisions] == [False, False, False, True] * 2  # every 4th refusal explores
    assert not slow.decide(10, explore=False).load  # a second look never explores
    assert slow.stats()["cost_tokens_recomputed_although_cached"] == 7 * 160
    assert make_load_policy("always_load", 1, 1).decide(10).load
    with pytest.raises(ValueError):
        make_load_policy("sometimes", 1, 1)


def test_a_load_slower_than_recompute_wins_behind_queued_prefills():
    """1 s to load 10 pages, 0.1 s to recompute them: refused alone; taken when 2,000 prefill tokens
    (1.25 s at 1,600 tok/s) run first, and the estimate it reports is the wait plus the recompute."""
    cm = CostModel(page_bytes=1_000_000, page_size=16, explore_every=100)
    cm.observe_prefill(1600, 1.0)
    cm.observe_read(10_000_000, 1.0)
    assert not cm.decide(10).load
    d = cm.decide(10, backlog_tokens=2000)
    assert d.load and "queued" in d.reason and d.recompute_s == pytest.approx((160 + 2000) / 1600)
    assert not cm.decide(10, backlog_tokens=1000).load  # 0.725 s: still faster than loading


def test_prefill_backlog_counts_what_runs_first():
    from serving.cache.prefetch_op import PrefetchOp
    from serving.structs.req_kv import ReqKV
    from serving.structs.request import Req
    from serving.structs.sampling_params import SamplingParams

    def req(rid: str, n: int, created: float, kv_len: int = 0, prefetch: PrefetchOp | None = None) -> Req:
        return Req(rid, list(range(n)), SamplingParams(max_new_tokens=1), created=created,
                   kv=ReqKV(kv_len=kv_len, prefetch=prefetch))
    running = [req("a", 1000, 0.0, kv_len=600), req("done", 500, 0.0, kv_len=499)]  # 400 left; one decoding
    # b: 20 pages of 16 cached at its lookup
    early, me, late = req("b", 800, 1.0, prefetch=PrefetchOp(20, list(range(320)), 0.0)), req("me", 900, 2.0), \
        req("c", 700, 3.0)
    assert prefill_backlog(me, running, [early, me, late], 16) == 400 + (800 - 320)
    assert prefill_backlog(early, running, [early, me, late], 16) == 400


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize(("read_mb_s", "loads"), [(2.0, False), (0.0, True)])
def test_engine_loads_only_when_faster(tmp_path, slow_lmdb, read_mb_s, loads):  # noqa: F811
    """Two prompts are in L3 (written by an earlier engine). A new engine first serves three
    uncached prompts (it learns the prefill rate), then the first stored prompt (it loads: the
    store's speed is not known yet), then the second: with the store throttled to 2 MB/s
    (SmolLM2 has 46 KB of KV per token: ~6 s for 256 tokens, against a fraction of a second to
    recompute even on a busy 2-core machine; at 8 MB/s a loaded CI machine's prefill rate made
    loading look faster) it recomputes, decided before even looking the pages up; unthrottled
    it loads.
    Answers equal the cold ones either way."""
    model = str(smollm2_path())
    db = tmp_path / "l3"
    *warmup, s0, s1 = _prompts(1, 5, 256)
    stored = [s0, s1]
    cfg = dict(model_path=model, page_size=16, max_total_tokens=4096, hicache_ratio=2.0,
               hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=64,
               hicache_storage_prefetch_timeout_base=30.0)
    warm = Engine(**cfg, hicache_storage_backend="lmdb",
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 1.0})
    cold = [o["output_ids"] for o in warm.generate(input_ids=stored, sampling_params=GREEDY)]
    warm.shutdown()  # persists both prompts to L3
    eng = Engine(**cfg, hicache_storage_backend=slow_lmdb,
                 hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 1.0, "read_mb_s": read_mb_s})
    for p in warmup:  # the prefill rate: the median of these steps (the first one starts things up)
        eng.generate(input_ids=p, sampling_params=GREEDY)
    first = eng.generate(input_ids=stored[0], sampling_params=GREEDY)
    assert first["meta_info"]["l3_decision"]["load"] and first["meta_info"]["cached_tokens_details"]["storage"] > 0
    second = eng.generate(input_ids=stored[1], sampling_params=GREEDY)
    decision = second["meta_info"]["l3_decision"]
    print(f"read_mb_s={read_mb_s}: {decision}")
    assert decision["load"] is loads, decision
    assert decision["looked_up"] is loads  # refused before the lookup: no store call at all
    assert (second["meta_info"]["cached_tokens_details"]["storage"] > 0) is loads
    assert [first["output_ids"], second["output_ids"]] == cold
    st = eng.core.storage_stats()
    assert st["cost_l3_refusals"] == (0 if loads else 1)
    assert st["cost_tokens_recomputed_although_cached"] == (0 if loads else decision["tokens"])
    eng.check_integrity()
    eng.shutdown()


def test_load_budget_arithmetic():
    """serving/cache/prefetch_policy.py's LoadBudget: no budget without both estimates; the cut comes once
    the fetch is older than the load estimate (at least MIN_CUT_S) and behind recompute by CUT_GRACE."""
    assert LoadBudget.of(None, 1.0, 10, 10, 0.0) is None and LoadBudget.of(0.5, None, 10, 10, 0.0) is None
    b = LoadBudget.of(0.2, 1.0, 10, 10, now=100.0)  # 0.1 s to recompute a page
    assert b.floor_s == 0.2 and b.page_recompute_s == pytest.approx(0.1)
    assert not b.exceeded(reading=0, now=100.19)  # younger than its estimate
    assert b.exceeded(reading=0, now=100.2)  # nothing read: behind from the start
    assert not b.exceeded(reading=5, now=100.59) and b.exceeded(reading=5, now=100.61)  # (5 + 0.1 * 10) * 0.1 s
    assert LoadBudget.of(0.001, 1.0, 10, 10, 0.0).floor_s == MIN_CUT_S


@pytest.mark.slow
def test_a_fetch_that_falls_behind_recompute_is_cut(tmp_path, slow_lmdb):  # noqa: F811
    """Three prompts are in L3. The engine learns the prefill rate and, from the first two loads, that the
    store is fast; then the store stalls (every read held at its start) while the third prompt's fetch
    runs. With ``wait_complete`` the request would wait for the fetch for ever; the cost model's budget
    cuts it once it is behind recompute: the request recomputes what had not landed (all of it here),
    answers as cold, and reports the cut (meta_info's l3_decision, the storage counters)."""
    db = tmp_path / "l3"
    *warmup, s0, s1, s2 = _prompts(2, 6, 256)
    stored = [s0, s1, s2]
    cfg = dict(model_path=str(smollm2_path()), page_size=16, max_total_tokens=4096, hicache_ratio=2.0,
               hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=64)
    warm = Engine(**cfg, hicache_storage_backend="lmdb",
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 1.0})
    cold = [o["output_ids"] for o in warm.generate(input_ids=stored, sampling_params=GREEDY)]
    warm.shutdown()  # persists them to L3
    eng = Engine(**cfg, hicache_storage_backend=slow_lmdb,
                 hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 1.0})
    store = eng.core.storage.tier.backend
    for p in warmup:
        eng.generate(input_ids=p, sampling_params=GREEDY)
    for p, want in zip(stored[:2], cold[:2], strict=True):  # the store measured: fast
        out = eng.generate(input_ids=p, sampling_params=GREEDY)
        assert out["output_ids"] == want and out["meta_info"]["cached_tokens_details"]["storage"] > 0
        eng.core.storage.poll(wait=True)
    store.hold()
    got: list = []
    t = threading.Thread(target=lambda: got.append(eng.generate(input_ids=s2, sampling_params=GREEDY)))
    t.start()
    t.join(timeout=60)
    store.release()  # (a hung request ends once its reads may go on)
    t.join(timeout=60)
    assert got, "the request waited for a stalled fetch"
    out = got[0]
    decision = out["meta_info"]["l3_decision"]
    print(decision)
    assert decision["load"] and decision["reason"] == "load is faster" and decision.get("cut"), decision
    assert decision["pages_recomputed"] > 0 and out["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert out["output_ids"] == cold[2]
    eng.core.storage.poll(wait=True)
    st = eng.core.storage_stats()
    assert st["fetches_cut"] == 1 and st["pages_cut"] == decision["pages_recomputed"], st
    eng.check_integrity()
    eng.shutdown()
