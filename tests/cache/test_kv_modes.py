"""Tier exactness in every KV mode: within one mode, greedy answers from a cold recompute, L1
hits, L2 hits and L3 hits after a restart are token-identical (fp32 CPU, the same batches), and
a page that went down to L2 and came back holds the very bytes L1 held."""

from __future__ import annotations

import pytest
import torch

from harness.engine_cases import GREEDY, ids_of, tier_prompts
from harness.kv_modes import check_mode, make, tier_hits
from harness.model_utils import hf_greedy, tiny_model
from serving.engine import Engine

# name -> engine kwargs. A lossy lower tier makes L1 store what that tier gives back.
MODES = {
    "raw": {},
    "l2_fp8": {"hicache_l2_encoding": "fp8"},
    "l2_int8_l3_int8": {"hicache_l2_encoding": "int8", "hicache_l3_encoding": "int8"},
    "l3_fp8": {"hicache_l3_encoding": "fp8"},
    "kv_fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "kv_bf16_l2_int8": {"kv_cache_dtype": "bf16", "hicache_l2_encoding": "int8"},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("kvmodes"))
    ps, others = tier_prompts()
    return path, ps, others, hf_greedy(path, ps, GREEDY["max_new_tokens"])


@pytest.mark.parametrize("mode", list(MODES))
def test_recompute_l1_l2_l3_identical_in_every_kv_mode(tiny, tmp_path, mode):
    path, ps, others, ref = tiny
    check_mode(path, ps, others, ref, tmp_path / "l3", MODES[mode], "page_first")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["l2_fp8", "l2_int8_l3_int8", "l3_fp8", "kv_fp8_e4m3"])
def test_recompute_l1_l2_l3_identical_layer_first(tiny, tmp_path, mode):
    path, ps, others, ref = tiny
    check_mode(path, ps, others, ref, tmp_path / "l3", MODES[mode], "layer_first")


def test_l3_written_in_one_encoding_is_a_miss_in_another(tiny, tmp_path):
    path, ps, _, _ = tiny
    db = tmp_path / "l3"
    eng = make(path, db, MODES["l2_int8_l3_int8"])
    eng.generate(input_ids=ps, sampling_params=GREEDY)
    eng.core.storage.poll(wait=True)
    eng.shutdown()  # persists every page, int8
    fresh = make(path, tmp_path / "empty", MODES["l3_fp8"])
    cold = ids_of(fresh.generate(input_ids=ps, sampling_params=GREEDY))
    fresh.shutdown()
    eng = make(path, db, MODES["l3_fp8"])  # the same LMDB directory, another encoding
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(outs) == cold
    assert tier_hits(outs, "storage") == 0
    stats = eng.core.storage.tier.stats()
    assert stats["hits"] == 0 and stats["corrupt"] == 0  # its keys live in another namespace
    eng.check_integrity()
    eng.shutdown()


@pytest.mark.slow
def test_tp2_encodes_each_ranks_shard_and_matches_tp1(tiny, tmp_path):
    """Scales are per (token, kv head), so each rank encoding its own heads gives TP=1's values:
    TP=2 answers equal TP=1's in the same mode, from L2 and from L3 after a restart."""
    path, ps, others, ref = tiny
    mode = MODES["l2_int8_l3_int8"]
    # two ranks on two GPUs where there are, else on the CPU (gloo; a one-GPU host too)
    dev = {} if torch.cuda.device_count() >= 2 else {"device": "cpu"}
    one = make(path, tmp_path / "tp1", mode, **dev)
    want = ids_of(one.generate(input_ids=ps, sampling_params=GREEDY))
    one.shutdown()
    eng = make(path, tmp_path / "tp2", mode, tp_size=2, **dev)
    assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == want
    eng.generate(input_ids=others, sampling_params=GREEDY)
    back = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(back) == want and tier_hits(back, "host") > 0
    eng.check_integrity()
    eng.shutdown()
    eng = make(path, tmp_path / "tp2", mode, tp_size=2, **dev)
    try:
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
        assert ids_of(outs) == want and tier_hits(outs, "storage") > 0
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (run by the GPU machine's suite)")
@pytest.mark.parametrize("mode", ["l2_int8_l3_int8", "l2_fp8"])
def test_cuda_triton_round_trip_is_exact_too(tiny, tmp_path, mode):
    """On CUDA (Triton kernels, CUDA graphs, overlap) the round trip runs before the store kernel;
    fp32 so that the cold run is a fair reference. Not run on the CPU machine it was written on."""
    path, ps, others, ref = tiny
    check_mode(path, ps, others, ref, tmp_path / "l3", {**MODES[mode], "dtype": "float32"}, "page_first")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_fp8_kv_runs_on_both_backends(tiny, tmp_path, backend):
    """An fp8 L1 on the Triton kernels (store saturates, attention upcasts) and on torch: the
    second run, served from the fp8 cache, gives the first run's tokens. float32 weights: in bf16
    the suffix-only prefill of a cache hit rounds differently from the cold one's GEMMs. (The
    Triton case failed once in bf16 on the H200, cause not captured, then passed 4 times.)"""
    path, ps, _, _ = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=512, kv_cache_dtype="fp8_e4m3",
                 attention_backend=backend, hicache_ratio=2.0, dtype="float32")
    try:
        first = ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY))
        assert ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY)) == first
        eng.check_integrity()
    finally:
        eng.shutdown()
