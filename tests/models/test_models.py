"""Our paged Llama / Qwen2 against HF transformers on tiny random checkpoints."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hicache.tiers.device import DeviceKVPool
from serving.kernels.attention import get_attention_backend
from serving.models.arch_config import ModelArchConfig
from serving.models.loader import load_model
from serving.models.registry import get_model_class, supported_architectures
from serving.structs.forward_batch import ForwardBatch

ATOL = 1e-4
PAGE_SIZE = 4
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# transformers' config and model classes by name (imported by the fixture: not at collection)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama_tied_llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    ),
    "llama_linear_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, use_sliding_window=False)),
    # q/k per-head RMSNorms (randomized below: "norm" in their names), head_dim apart from hidden / heads
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, attention_bias=True, use_sliding_window=False)),
    # a sparse layer (8 experts, top 2, renormalized) then a dense one (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        mlp_only_layers=[1], use_sliding_window=False)),
    # sinks, alternating 4-token windows, YaRN, experts with biases and the clamped gated activation
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])),
    # MLA with q_lora_rank (V2's shape), YaRN (mscale_all_dim: the softmax scale too), greedy routing over
    # every expert, shared experts, the first layer dense
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1,
        first_k_dense_replace=1, topk_method="greedy", routed_scaling_factor=2.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 32})),
    # V2-Lite's shape (no q_lora_rank), a latent of 30 + 8 (19 per cache plane), group-limited routing
    # (4 groups, the best 2), every layer sparse, 2 shared experts
    "deepseek_v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=30, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, n_shared_experts=2,
        first_k_dense_replace=0, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.0)),
    # V3's router (noaux_tc: sigmoid, a correction bias for the choice, groups by their two best, normalized
    # then scaled), MLA with q_lora_rank, the first layer dense
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    # every layer sparse (decoder_sparse_step 1), top 3 probabilities as they are
    "qwen3_moe_unnormed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
        use_sliding_window=False)),
}


def _randomize(model: torch.nn.Module) -> None:
    """Non-trivial values everywhere (HF inits norms at 1 and biases at 0, which would hide bugs)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if "correction_bias" in name:  # DeepSeek-V3's router bias: enough to change the choice
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    import transformers

    cfg_name, model_name, extra = CASES[request.param]
    cfg_cls, model_cls = getattr(transformers, cfg_name), getattr(transformers, model_name)
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**{**COMMON, **extra}, attn_implementation="eager")).eval()
    _randomize(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, hf


class Runner:
    """Our model + KV pool + page bookkeeping for a few sequences (pages deliberately shuffled)."""

    def __init__(self, path: Path, num_pages: int = 64) -> None:
        self.model, self.cfg = load_model(path)
        self.pool = DeviceKVPool(self.cfg.kv_layout(torch.float32), num_pages, PAGE_SIZE, "cpu")
        self.attn = get_attention_backend("torch")
        self.free = list(range(1, num_pages))
        random.Random(0).shuffle(self.free)
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, new: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run ``new`` token ids for each sequence id on top of its cached KV."""
        seqs = []
        for sid, ids in new.items():
            prefix = self.lens.get(sid, 0)
            pages = self.pages.setdefault(sid, [])
            while len(pages) * PAGE_SIZE < prefix + len(ids):
                pages.append(self.free.pop())
            seqs.append((ids, prefix, list(pages)))
            self.lens[sid] = prefix + len(ids)
        batch = ForwardBatch.build(seqs, PAGE_SIZE)
        logits = self.model(batch, self.pool, self.attn)
        assert logits.dtype == torch.float32 and logits.shape == (len(new), self.cfg.vocab_size)
        return dict(zip(new, logits, strict=True))


def _hf_last_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


PROMPTS = {0: list(range(3, 20)), 1: [7, 8], 2: [100, 5, 6, 200, 9, 1, 2, 3, 4], 3: [42] * 13}


def test_whole_prompt_then_decode(checkpoint) -> None:
    path, hf = checkpoint
    run = Runner(path)
    out = run.step(PROMPTS)
    seqs = {sid: list(ids) for sid, ids in PROMPTS.items()}
    for _ in range(3):
        for sid, logits in out.items():
            ref = _hf_last_logits(hf, seqs[sid])
            torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
            seqs[sid].append(int(logits.argmax()))
        out = run.step({sid: [ids[-1]] for sid, ids in seqs.items()})  # decode batch


def test_prefix_reuse_two_steps(checkpoint) -> None:
    """Prefix in one step, rest in a second step reading the prefix from pages."""
    path, hf = checkpoint
    run = Runner(path)
    split = {0: 9, 1: 1, 2: 4, 3: 12}
    first = run.step({sid: PROMPTS[sid][: split[sid]] for sid in PROMPTS})
    for sid, logits in first.items():
        torch.testing.assert_close(logits, _hf_last_logits(hf, PROMPTS[sid][: split[sid]]), atol=ATOL, rtol=0)
    second = run.step({sid: PROMPTS[sid][split[sid] :] for sid in PROMPTS})  # mixed: seq 3 adds 1 token
    for sid, logits in second.items():
        torch.testing.assert_close(logits, _hf_last_logits(hf, PROMPTS[sid]), atol=ATOL, rtol=0)


def test_prefix_is_really_read_from_pages(checkpoint) -> None:
    """Corrupting the cached prefix must change the second step's logits (the test can fail)."""
    path, hf = checkpoint
    run = Runner(path)
    run.step({0: PROMPTS[0][:8]})
    for buf in run.pool.k_buffers:
        buf[run.pages[0][0]] += 1.0
    logits = run.step({0: PROMPTS[0][8:]})[0]
    assert not torch.allclose(logits, _hf_last_logits(hf, PROMPTS[0]), atol=ATOL)


def test_dummy_load_format(checkpoint) -> None:
    path, _ = checkpoint
    model, cfg = load_model(path, load_format="dummy", overrides={"num_hidden_layers": 3})
    assert cfg.num_hidden_layers == 3 and len(model.model.layers) == 3
    pool = DeviceKVPool(cfg.kv_layout(torch.float32), 8, PAGE_SIZE, "cpu")
    batch = ForwardBatch.build([([1, 2, 3, 4, 5], 0, [1, 2]), ([9], 0, [3])], PAGE_SIZE)
    logits = model(batch, pool, get_attention_backend("torch"))
    assert logits.shape == (2, cfg.vocab_size) and torch.isfinite(logits).all()
    again, _ = load_model(path, load_format="dummy", overrides={"num_hidden_layers": 3})
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)  # seeded


def test_config_parsing_variants() -> None:
    base = {**COMMON, "architectures": ["LlamaForCausalLM"], "eos_token_id": [1, 2]}
    old = ModelArchConfig.from_dict(
        {**base, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    )
    new = ModelArchConfig.from_dict(
        {**base, "rope_parameters": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}}
    )
    assert old == new and old.rope_theta == 500000.0 and old.rope_scaling.factor == 4.0
    assert old.eos_token_id == (1, 2) and old.head_dim == 16
    plain = ModelArchConfig.from_dict(
        {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    )
    assert plain.rope_scaling is None


def test_registry() -> None:
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(supported_architectures())
    with pytest.raises(ValueError, match="unsupported"):
        get_model_class(["GPT2LMHeadModel"])
