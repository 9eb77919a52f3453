"""Nemotron-H (Mamba2 + attention + MLP blocks) against HF transformers on a tiny random checkpoint,
CPU fp32 (the checks: harness/state_model_checks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness import state_model_checks as checks
from harness.state_runner import StateRunner, hf_checkpoint, hf_last_logits
from serving.models.arch_config import ModelArchConfig
from serving.models.layer_spec import LayerKind
from serving.models.nemotron_h import NemotronHForCausalLM

# Mamba2, attention, MLP, Mamba2, Mamba2, attention, MLP; 8 Mamba heads in 2 groups; GQA attention.
# HF clamps dt at time_step_min in its whole-sequence forward (the prompt in generate) but not in its
# one-token decode step; we clamp every token (one state whatever the chunking, test_dt_clamp_every_token).
# The comparisons with HF's generate run where the clamp never binds (time_step_min ~ 0), so HF's two
# paths agree there.
FAMILY = dict(hybrid_override_pattern="M*-MM*-", vocab_size=512, time_step_min=1e-9)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    return hf_checkpoint(tmp_path_factory.mktemp("nemotron_h"), "nemotron_h", **FAMILY)


def test_dt_clamp_every_token(tmp_path) -> None:
    """With time_step_min 0.001 (where softplus(dt) falls below it for some heads and tokens), tokens
    run one at a time give HF's whole-sequence forward, which clamps every token."""
    path, hf = hf_checkpoint(tmp_path, "nemotron_h", **{**FAMILY, "time_step_min": 0.001})
    prompt = checks._prompt(50, 40, 512)
    with torch.no_grad():
        layer = hf.model.layers[0]
        proj = layer.mixer.in_proj(layer.norm(hf.model.embeddings(torch.tensor(prompt))))
        dt = torch.nn.functional.softplus(proj[:, -layer.mixer.num_heads:] + layer.mixer.dt_bias)
    assert bool((dt < 0.001).any())  # the clamp binds (in the first Mamba layer already)
    run = StateRunner(path)
    run.step({0: prompt[:20]})
    for tok in prompt[20:-1]:
        run.step({0: [tok]})
    checks._close(run.step({0: prompt[-1:]})[0], hf_last_logits(hf, prompt))


def test_layer_stack_and_state_layout(checkpoint) -> None:
    path, _ = checkpoint
    cfg = ModelArchConfig.from_pretrained(path)
    assert cfg.num_hidden_layers == 7 and "num_hidden_layers" not in cfg.raw  # transformers 5 leaves it out
    model = NemotronHForCausalLM(cfg)
    stack = model.layer_stack
    assert [s.kind for s in stack.specs] == [LayerKind.MAMBA, LayerKind.FULL, LayerKind.MLP, LayerKind.MAMBA,
                                              LayerKind.MAMBA, LayerKind.FULL, LayerKind.MLP]
    assert stack.kv_layers == (1, 5) and stack.state_layers == (0, 3, 4)
    layout = model.state_layout(torch.float16)
    conv_dim = 8 * 8 + 2 * 2 * 16  # x (8 heads x 8) and B, C (2 groups x state 16)
    assert [(t.name, t.shape, t.dtype) for t in layout.layers[2]] == [
        ("conv", (conv_dim, 3), torch.float16), ("recurrent", (8, 8, 16), torch.float32)]


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


def test_patterns_and_refusals(checkpoint) -> None:
    path, _ = checkpoint
    raw = {k: v for k, v in ModelArchConfig.from_pretrained(path).raw.items() if k != "layers_block_type"}
    hub = NemotronHForCausalLM(ModelArchConfig.from_dict({**raw, "hybrid_override_pattern": "M*-MM*-",
                                                          "num_hidden_layers": 7}))
    assert hub.layer_stack.state_layers == (0, 3, 4)  # the Hub's pattern string reads as the list
    with pytest.raises(ValueError, match=r"mixture-of-experts blocks \(layers \[2\]\) are not supported"):
        NemotronHForCausalLM(ModelArchConfig.from_dict({**raw, "hybrid_override_pattern": "M*EM"}))
    with pytest.raises(ValueError, match=r"mixture-of-experts blocks \(layers \[1\]\)"):
        NemotronHForCausalLM(ModelArchConfig.from_dict({**raw, "layers_block_type": ["mlp", "moe"]}))
    with pytest.raises(ValueError, match="unknown Nemotron-H block types"):
        NemotronHForCausalLM(ModelArchConfig.from_dict({**raw, "hybrid_override_pattern": "M*X"}))
