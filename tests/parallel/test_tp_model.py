"""Tensor-parallel model math on CPU (gloo): TP=N greedy tokens equal TP=1's, fp32."""

from __future__ import annotations

import pytest

from harness.model_utils import smollm2_path, tiny_model
from harness.tp_utils import greedy, greedy_tp
from serving.models.arch_config import ModelArchConfig
from serving.parallel.shard import ShardPlan, TPShapeError

PROMPTS = [list(range(3, 40)), [7, 8, 9], [100, 5, 6, 200, 9, 1, 2, 3, 4, 11, 12], [42] * 13]


@pytest.mark.parametrize(("arch", "kv_heads", "size"), [
    ("llama", 2, 2),  # GQA, kv heads split
    ("qwen2", 2, 2),  # GQA + q/k/v bias
    ("llama", 1, 2),  # fewer kv heads than ranks: replicated
    ("qwen2", 2, 4),  # replicated, two ranks per kv head
    ("qwen3", 2, 2),  # per-head q/k norms (replicated weights), head_dim 32
    ("qwen3_moe", 2, 2),  # every expert's intermediate split over the ranks, one all-reduce
    ("gpt_oss", 2, 2),  # sinks by q head, expert biases once, windows
    ("deepseek_v2", 4, 2),  # MLA: q heads split, the latent replicated; shared experts split
])
def test_tiny_tp_matches_single_rank(tmp_path, arch, kv_heads, size) -> None:
    path = tiny_model(tmp_path / "m", arch=arch, num_key_value_heads=kv_heads, vocab_size=501)  # 501: padded vocab
    ref = greedy(str(path), PROMPTS, 12)
    outs = greedy_tp(path, PROMPTS, 12, size, tmp_path)
    for rank, out in enumerate(outs):
        assert out == ref, f"rank {rank}"
    assert len({tuple(o) for o in ref}) > 1  # the prompts give different continuations


@pytest.mark.slow
def test_smollm2_tp3_matches_single_rank(tmp_path) -> None:
    """SmolLM2-135M has 9 heads and 3 kv heads: TP=3 (TP=2 does not divide it)."""
    path = smollm2_path()
    ref = greedy(str(path), PROMPTS[:2], 8)
    outs = greedy_tp(path, PROMPTS[:2], 8, 3, tmp_path)
    assert outs[0] == ref


def test_shape_checks_name_the_problem() -> None:
    cfg = ModelArchConfig.from_pretrained(smollm2_path())
    with pytest.raises(TPShapeError, match="does not divide the model's 9 attention heads"):
        ShardPlan.for_model(cfg, 0, 2)
    plan = ShardPlan.for_model(cfg, 2, 3)
    assert (plan.num_heads, plan.num_kv_heads, plan.kv_head_start, plan.intermediate) == (3, 1, 2, 512)


def test_replicated_kv_head_is_the_one_its_q_heads_use() -> None:
    """8 q heads, 2 kv heads, 4 ranks: rank r's q heads are 2r, 2r+1; they use kv head (2r) // 4."""
    cfg = ModelArchConfig.from_dict({"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64,
                                     "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 10})
    for r in range(4):
        plan = ShardPlan.for_model(cfg, r, 4)
        assert plan.num_kv_heads == 1 and plan.kv_head_start == (2 * r) // 4


def test_tp_shard_keys() -> None:
    """The part holding kv head 0 keeps rank 0's key; other kv-head ranges get their own keys."""
    from hicache.keys import page_keys, tp_shard_key

    (k,) = page_keys(list(range(4)), 4, "m|L2.H1.D16.float32|tp0")
    assert tp_shard_key(k, 0, 1) == k
    others = {tp_shard_key(k, s, n) for s, n in ((1, 1), (2, 1), (2, 2), (4, 2))}
    assert len(others) == 4 and k not in others
    assert tp_shard_key(k, 1, 1) == tp_shard_key(k, 1, 1)
    with pytest.raises(ValueError):
        tp_shard_key("not-a-key", 1, 1)
