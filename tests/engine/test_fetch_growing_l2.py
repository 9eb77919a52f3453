"""An L3 fetch right after a start, while L2 is still being pinned (hicache.tiers.host_pinning; held on CPU by
HICACHE_TEST_HOLD_L2_PIN): a prefix larger than the pinned part of L2 waits for L2 to grow and comes back
from L3 whole, instead of being fetched into the part that is pinned and recomputed past it (on an H100 a
32k-token prefix so took 1.85x recompute: 2,032 of its tokens from L3). A tiny Llama of 8 KiB of KV a token,
L2 pinned in 16 MiB chunks (2,048 tokens each) and a 4,096-token prompt; the pinning is held until 0.5 s
after the returning request arrives."""

from __future__ import annotations

import threading

from harness.engine_cases import lmdb_l3
from harness.model_utils import tiny_model
from hicache.tiers import host_pinning
from hicache.tiers.host_pinning import HOLD_ENV
from serving.engine import Engine

ONE = {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}


def test_a_fetch_after_a_start_waits_for_l2_to_grow(tmp_path, monkeypatch):
    path = tiny_model(tmp_path / "m", num_hidden_layers=4, num_key_value_heads=4, num_attention_heads=4,
                      hidden_size=256, head_dim=64, max_position_embeddings=8192)
    prompt = [(13 * i) % 500 + 3 for i in range(4096)]
    kw = dict(model_path=str(path), device="cpu", page_size=16, max_total_tokens=8192, hicache_size=0.25,
              chunked_prefill_size=8192, hicache_mem_layout="page_first", **lmdb_l3(tmp_path / "l3", capacity_gb=0.2))
    monkeypatch.setattr(host_pinning, "CHUNK_MIN", 8 << 20)  # 256 MiB / 16: 16 MiB chunks
    first = Engine(**kw)
    try:
        want = first.generate(input_ids=prompt, sampling_params=ONE)["output_ids"]
        first.core.storage.poll(wait=True)
    finally:
        first.shutdown()
    hold = tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv(HOLD_ENV, str(hold))
    eng = Engine(**kw)
    try:
        host = eng.core.host_pool
        assert host.growing and host.allocator.available * 16 < len(prompt)  # the pinned part holds less
        threading.Timer(0.5, hold.unlink).start()
        out = eng.generate(input_ids=prompt + [7], sampling_params=ONE)
        got = out["meta_info"]["cached_tokens_details"]
        assert got["storage"] == len(prompt), got  # all of it from L3 (before: the pinned part's pages)
        assert out["output_ids"] == eng.generate(input_ids=prompt + [7], sampling_params=ONE)["output_ids"]
        eng.check_integrity()
    finally:
        eng.shutdown()
    assert want
