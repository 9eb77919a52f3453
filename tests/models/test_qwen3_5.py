"""Qwen3.5 text (Gated DeltaNet + gated full attention) against HF transformers on a tiny random
checkpoint, CPU fp32 (the checks: harness/state_model_checks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import state_model_checks as checks
from harness.state_runner import hf_checkpoint
from serving.models.arch_config import ModelArchConfig
from serving.models.layer_spec import LayerKind
from serving.models.qwen3_5 import Qwen3_5ForCausalLM

# 6 layers: linear, full, linear, linear, full, linear; GQA in both kinds of layer
FAMILY = dict(num_hidden_layers=6, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                "linear_attention", "full_attention", "linear_attention"],
              vocab_size=512)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    return hf_checkpoint(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", **FAMILY)


def test_layer_stack_and_state_layout(checkpoint) -> None:
    path, _ = checkpoint
    model = Qwen3_5ForCausalLM(ModelArchConfig.from_pretrained(path))
    stack = model.layer_stack
    assert [s.kind for s in stack.specs] == [LayerKind.LINEAR, LayerKind.FULL, LayerKind.LINEAR,
                                              LayerKind.LINEAR, LayerKind.FULL, LayerKind.LINEAR]
    assert stack.kv_layers == (1, 4) and stack.state_layers == (0, 2, 3, 5)
    layout = model.state_layout(torch.bfloat16)
    conv_dim = 2 * 2 * 16 + 4 * 16  # q, k (2 key heads x 16) and v (4 value heads x 16)
    assert layout.num_layers == 4
    assert [(t.name, t.shape, t.dtype) for t in layout.layers[0]] == [
        ("conv", (conv_dim, 3), torch.bfloat16), ("recurrent", (4, 16, 16), torch.float32)]
    assert model.rotary.inv_freq.numel() == 2  # partial_rotary_factor 0.25 of head_dim 16: 4 dims turn


def test_prefill_logits_match_hf(checkpoint) -> None:
    checks.check_prefill(*checkpoint)


def test_greedy_matches_hf(checkpoint) -> None:
    checks.check_greedy(checkpoint[0])


def test_chunked_prefill_equals_one_forward(checkpoint) -> None:
    checks.check_chunked(*checkpoint)


def test_snapshot_restored_continues_the_same(checkpoint) -> None:
    checks.check_snapshot(checkpoint[0])


def test_state_is_really_read(checkpoint) -> None:
    checks.check_state_is_read(*checkpoint)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_model_runner_builds_the_state_pool(checkpoint, backend) -> None:
    checks.check_model_runner(*checkpoint, backend)


def test_refusals(checkpoint) -> None:
    path, _ = checkpoint
    raw = dict(ModelArchConfig.from_pretrained(path).raw)
    with pytest.raises(ValueError, match="not supported"):
        Qwen3_5ForCausalLM(ModelArchConfig.from_dict({**raw, "layer_types": ["sliding_attention"] * 6}))
    with pytest.raises(ValueError, match="5 entries for 6 layers"):
        Qwen3_5ForCausalLM(ModelArchConfig.from_dict({**raw, "layer_types": raw["layer_types"][:5]}))
