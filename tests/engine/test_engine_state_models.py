"""Models with recurrent-state layers in the engine (issue 43): a tiny random Qwen3.5 (Gated DeltaNet +
gated attention) and Nemotron-H (Mamba2 + attention + MLP blocks), float32 on CPU. Each request computes
its state in a working slot of the L1 state pool and leaves snapshots to the tree
(serving/cache/request_states.py), so a repeated prompt resumes from one: it gives HF's greedy tokens and
reports cached tokens; chunked prefills and concurrent requests keep their own states, a retracted
request resumes exactly, no slot leaks, and the state pool's default size stays within
--mamba-full-memory-ratio of the KV cache's bytes."""

from __future__ import annotations

import pytest
import torch

from harness.engine_cases import ids_of, prompts
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
FAMILIES = {"qwen3_5": {}, "nemotron_h": {"hybrid_override_pattern": "M*-MM*-", "time_step_min": 1e-9}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp(request.param), request.param, **FAMILIES[request.param])
    ps = prompts(5, 512, seed=3, lo=20, hi=60)
    return path, ps, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def test_greedy_matches_hf_batched_chunked_and_repeated(tiny) -> None:
    path, ps, ref = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, chunked_prefill_size=16)
    try:
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref  # concurrent, chunks of 16
        eng.check_integrity()
        again = eng.generate(input_ids=ps, sampling_params=GREEDY)  # from the prompt captures' snapshots
        assert ids_of(again) == ref
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in again), [o["meta_info"] for o in again]
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_retracted_requests_resume_exactly(tiny) -> None:
    """A retracted request gives its pages and its captures to the tree and resumes from them."""
    path, ps, ref = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=96, max_running_requests=5)
    try:
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        assert eng.core.scheduler.stats.retractions > 0  # the small L1 made it retract
        state = eng.core.runner.state_pool  # every slot left is a tree snapshot's
        assert state.num_used == eng.core.tree.state.cached_slots("device") > 0
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_speculative_decoding_gets_verify_scratch(tiny) -> None:
    """NGRAM runs on a state model (exactness: tests/engine/test_engine_state_spec.py): the state pool
    has scratch for the state after each draft of up to 8 verifying requests, outside its slots."""
    path, ps, ref = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, speculative_algorithm="NGRAM",
                 speculative_num_draft_tokens=4, max_running_requests=16)
    try:
        state = eng.core.runner.state_pool
        assert state.num_scratch == 3 * 8 and state.scratch_base == state.num_slots
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_state_pool_size_is_sglangs_max_mamba_cache_size(tiny) -> None:
    """--max-mamba-cache-size sets the L1 state slots; the default is 4 per running request + 8; fewer
    than one request's 3 slots and a snapshot is refused with the reason."""
    path, ps, ref = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=1024, max_mamba_cache_size=7)
    try:
        assert eng.core.runner.state_pool.num_slots == 7
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref  # 2 at a time, then 1 snapshot
        eng.check_integrity()
    finally:
        eng.shutdown()
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=256, max_running_requests=3)
    try:
        assert eng.core.runner.state_pool.num_slots == 4 * 3 + 8
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="max_mamba_cache_size must be at least 4"):
        Engine(model_path=str(path), page_size=4, max_total_tokens=256, max_mamba_cache_size=3)


def test_the_default_state_pool_of_the_9b_shape_stays_within_the_kv_ratio(tmp_path) -> None:
    """Qwen3.5's default text config (the 9B shape: 24 DeltaNet layers, ~51 MiB a state slot) on CPU:
    the default slots (4 per running request + 8: 264 at the default 64, 13 GiB) are capped so their
    bytes stay within --mamba-full-memory-ratio (0.9) x the KV cache's (the CPU default's 16384 tokens)."""
    from transformers import Qwen3_5TextConfig

    from hicache.tiers.device import KVLayout
    from serving.models.arch_config import ModelArchConfig
    from serving.models.registry import get_model_class
    from serving.runner.model_runner import CPU_DEFAULT_KV_TOKENS, STATE_FLOOR_BYTES, state_slots_for

    Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"]).save_pretrained(tmp_path)
    arch = ModelArchConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = get_model_class(arch.architectures)(arch)
    slot_bytes = model.state_layout(torch.float32).bytes_per_slot()
    per_token = KVLayout(len(model.layer_stack.kv_layers), arch.num_key_value_heads, arch.head_dim,
                         torch.float32).bytes_per_token()
    kv_bytes = CPU_DEFAULT_KV_TOKENS * per_token
    slots = state_slots_for(64, slot_bytes, kv_bytes, 0.9)
    assert 4 * 64 + 8 > slots >= 4, slots
    assert slots * slot_bytes <= max(0.9 * kv_bytes, STATE_FLOOR_BYTES), (slots, slot_bytes, kv_bytes)


def test_the_l2_state_pool_fits_beside_l2_in_the_hosts_memory(tiny, monkeypatch) -> None:
    """L2's state slots follow L2's page ratio (4 x L1's 40 here) only as far as the host's memory holds them
    beside L2's KV: clamped with a warning, and an error when not even one per L1 slot fits (before, the pool
    was allocated whatever the host had: on the H200 host Qwen3.5's 9B shape with a 32 GB L2 asked 28 GB more
    and the process was killed)."""
    from hicache.sizing import MEM_AVAILABLE_ENV, MEM_TOTAL_ENV, GiB

    path, ps, ref = tiny
    kw = dict(model_path=str(path), page_size=4, max_total_tokens=256, hicache_ratio=4.0, max_mamba_cache_size=40)
    eng = Engine(**kw)
    try:
        slot, kv, want = (eng.core.host_state_pool.bytes_per_slot, eng.core.host_pool.nbytes(),
                          eng.core.host_state_pool.num_slots)
    finally:
        eng.shutdown()
    assert want == 160
    monkeypatch.setenv(MEM_TOTAL_ENV, "4")  # headroom: 2 GiB
    monkeypatch.setenv(MEM_AVAILABLE_ENV, str(2 + (kv + 100 * slot) / GiB))
    eng = Engine(**kw)
    try:
        assert 90 <= eng.core.host_state_pool.num_slots <= 100
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == ref
        eng.check_integrity()
    finally:
        eng.shutdown()
    monkeypatch.setenv(MEM_AVAILABLE_ENV, str(2 + (kv + 20 * slot) / GiB))
    with pytest.raises(ValueError, match=r"L2 state pool: 40 slots \(one per L1 state slot\)"):
        Engine(**kw)
