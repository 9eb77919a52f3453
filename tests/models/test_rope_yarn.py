"""YaRN RoPE (GPT-OSS, DeepSeek): our inverse frequencies and cos/sin scale equal HF transformers'
``_compute_yarn_parameters`` for GPT-OSS's parameters (truncate off), a rounded ramp, mscale /
mscale_all_dim (DeepSeek-V3's form) and a factor taken from the context lengths."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from serving.models.arch_config import ModelArchConfig
from serving.models.rope import RotaryEmbedding

CASES = {
    "gpt_oss": dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                    original_max_position_embeddings=4096, truncate=False),
    "rounded": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=2048),
    "mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=0.707,
                   original_max_position_embeddings=4096, beta_fast=32, beta_slow=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_yarn_matches_hf(case, tmp_path) -> None:
    params = CASES[case]
    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=8192,
                         rope_parameters=params)
    inv_hf, scale_hf = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    hf_cfg.save_pretrained(tmp_path)
    rot = RotaryEmbedding(ModelArchConfig.from_pretrained(tmp_path))
    torch.testing.assert_close(rot.inv_freq, inv_hf.float(), rtol=1e-6, atol=0)
    assert rot.scale == pytest.approx(scale_hf, rel=1e-9)
    cos, _ = rot.tables(torch.device("cpu"), 16)
    assert float(cos[0, 0]) == pytest.approx(scale_hf)  # position 0: cos 1, scaled
