"""Model families in the engine with the HiCache tiers (issues 43, 45), prompts 5-8 windows long,
float32 on CPU: the sliding-window families, a tiny random Gemma-3 (2 sliding layers with an 8-token
window to 1 full), GPT-OSS (an 8-token window with attention sinks, then a full layer with sinks;
experts) and Mistral (every layer an 8-token window), whose every layer keeps its KV for every token
(docs/models.md), and Qwen3 (q/k norms) and Qwen3-MoE (experts). A prefix served from L1, from L2 (L1
too small to keep it), from L3 (LMDB, after a restart), from a second server through Mooncake,
through chunked-prefill boundaries inside a window, or to requests sharing a prefix that is still
loading, gives HF's greedy tokens, the same as recomputing it."""

from __future__ import annotations

import random

import pytest

from harness.engine_cases import ids_of, prompts, tier_prompts
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module", params=["gemma3", "gpt_oss", "mistral", "qwen3", "qwen3_moe"])
def tiny(request, tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    ps, others = tier_prompts()  # 40-60 tokens each
    rng = random.Random(8)
    shared = [rng.randrange(1, 511) for _ in range(36)]
    sharing = [shared + [rng.randrange(1, 511) for _ in range(n)] for n in (3, 9, 14, 21)]
    refs = hf_greedy(path, ps + others + sharing, GREEDY["max_new_tokens"])
    return path, ps, others, sharing, refs[: len(ps)], refs[len(ps) + len(others):]


def hits(outs, tier: str) -> list[int]:
    return [o["meta_info"]["cached_tokens_details"][tier] for o in outs]


def test_l1_hits_and_chunk_boundaries_inside_windows(tiny) -> None:
    path, ps, _, _, ref, _ = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, chunked_prefill_size=11)
    try:
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref  # cold, chunks of 11
        again = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(again) == ref and all(h > 0 for h in hits(again, "device")), hits(again, "device")
        longer = [p + [5, 6, 7] for p in ps[:2]]  # the prefix from L1, the rest computed
        assert ids_of(eng.generate(input_ids=longer, sampling_params=GREEDY)) == hf_greedy(path, longer, 10)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_prefix_comes_back_from_l2(tiny) -> None:
    path, ps, others, _, ref, _ = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=160, hicache_ratio=4.0,
                 hicache_write_policy="write_through", write_through_threshold=1, max_running_requests=2,
                 chunked_prefill_size=13)
    try:
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        eng.generate(input_ids=others, sampling_params=GREEDY)  # pushes ps out of L1
        assert eng.core.tree.cached_pages("host") > 0
        again = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(again) == ref
        assert sum(hits(again, "host")) > 0, [o["meta_info"] for o in again]
        eng.check_integrity()
    finally:
        eng.shutdown()


def _l3(path, db, **kw) -> Engine:
    return Engine(model_path=str(path), page_size=4, max_total_tokens=256, hicache_ratio=2.0,
                  hicache_storage_backend="lmdb",
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1},
                  hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=8,
                  hicache_storage_prefetch_timeout_base=30.0, hicache_storage_load_policy="always_load", **kw)


def test_prefix_comes_back_from_l3_after_restart_and_shared_while_loading(tiny, tmp_path) -> None:
    path, ps, _, sharing, ref, ref_sharing = tiny
    db = tmp_path / "l3"
    eng = _l3(path, db)
    try:  # two rounds: the second hits the first's pages, which are written on to L3
        for _ in range(2):
            assert ids_of(eng.generate(input_ids=ps + sharing[:1], sampling_params=GREEDY)) == ref + ref_sharing[:1]
        eng.core.storage.poll(wait=True)
        assert eng.core.storage.pages_written > 0
        eng.check_integrity()
    finally:
        eng.shutdown()
    eng = _l3(path, db, max_running_requests=1)  # a restart: L1 and L2 empty, LMDB holds the pages
    try:
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(outs) == ref
        assert all(h > 0 for h in hits(outs, "storage")), hits(outs, "storage")
        eng.check_integrity()
    finally:
        eng.shutdown()
    eng = _l3(path, db, max_running_requests=4)  # the shared prefix in L3 only: all four ask for it at once
    try:
        outs = eng.generate(input_ids=sharing, sampling_params=GREEDY)
        assert ids_of(outs) == ref_sharing
        assert sum(hits(outs, "storage")) > 0, [o["meta_info"] for o in outs]
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_concurrent_requests_sharing_a_prefix(tiny) -> None:
    path, _, _, sharing, _, ref_sharing = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, chunked_prefill_size=16,
                 max_running_requests=4)
    try:
        assert ids_of(eng.generate(input_ids=sharing, sampling_params=GREEDY)) == ref_sharing  # cold, together
        outs = eng.generate(input_ids=sharing[::-1], sampling_params=GREEDY)  # the shared prefix from L1
        assert ids_of(outs) == ref_sharing[::-1]
        assert all(h >= 32 for h in hits(outs, "device")), hits(outs, "device")
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_more_prompts_sampled_against_hf(tiny) -> None:
    """A batch of ragged prompts (3-70 tokens: shorter and longer than the window) in one mixed batch."""
    path = tiny[0]
    ps = prompts(6, 512, seed=21, lo=3, hi=70)
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024)
    try:
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == hf_greedy(path, ps, 10)
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_a_second_server_resumes_through_mooncake(tiny, tmp_path) -> None:
    """Server A serves first and second turns (writing their pages on to a real Mooncake Store, in a
    network namespace of its own); server B, fresh, on the same master, serves the second turns from
    there: storage hits, HF's tokens (the driver is the state models' one: tests/engine/test_engine_state_l3.py)."""
    import json
    from pathlib import Path

    from harness.netns import run_mooncake_script

    path, ps, _, _, ref, _ = tiny
    rng = random.Random(31)
    second = [p + r + [rng.randrange(1, 511) for _ in range(7)] for p, r in zip(ps, ref, strict=True)]
    ref2 = hf_greedy(path, second, GREEDY["max_new_tokens"])
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps({"first": ps, "second": second, "new": GREEDY["max_new_tokens"], "state": False}))
    res = run_mooncake_script(Path(__file__).parent / "mooncake_state_two_servers.py", str(path), str(tmp_path),
                              str(cases))
    assert res["a_first"] == ref and [o["ids"] for o in res["a_second"]] == ref2, res
    assert res["a_pages_stored"] and res["a_integrity"] and res["b_integrity"], res
    assert [o["ids"] for o in res["b_second"]] == ref2, res
    assert all(o["storage"] > 0 for o in res["b_second"]), res
