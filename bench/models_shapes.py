"""The shapes and byte arithmetic of bench/models.py: Qwen3-30B-A3B, DeepSeek-V2-Lite, Llama-3.1-70B
(their published config.json values), and decode rooflines over the bytes a step reads."""

from __future__ import annotations

HBM_BPS = 4.1e12  # the H200's HBM bandwidth the issues' rooflines use

QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
    tie_word_embeddings=False, hidden_act="silu")
DEEPSEEK_V2_LITE = dict(
    architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944,
    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1,
    topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
    vocab_size=102400, rope_theta=10000.0, max_position_embeddings=163840, rms_norm_eps=1e-6,
    tie_word_embeddings=False, hidden_act="silu")
LLAMA_70B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192, intermediate_size=28672,
    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
    rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=32000)
SMALL_MOE = dict(moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, n_routed_experts=8,
                 num_experts_per_tok_mla=2, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                 v_head_dim=32)

MODELS = {"qwen3_30b_a3b": QWEN3_30B_A3B, "deepseek_v2_lite": DEEPSEEK_V2_LITE, "llama_70b": LLAMA_70B}


def config(name: str, small: bool) -> dict:
    cfg = dict(MODELS[name])
    if small:
        cfg.update(SMALL)
        cfg.update({k: v for k, v in SMALL_MOE.items() if k in cfg})
        cfg["max_position_embeddings"] = 8192
    return cfg


def expert_bytes(cfg: dict, elem: int) -> int:
    """One expert's weights (gate, up, down)."""
    return 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * elem


def active_bytes(total_weight_bytes: int, cfg: dict, bs: int, elem: int) -> int:
    """Weight bytes a decode step of ``bs`` sequences reads: everything but the experts, and per MoE
    layer the experts its tokens pick (the expected number of distinct experts of ``bs`` tokens each
    taking ``k`` of ``E`` uniformly)."""
    e = cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    if not e:
        return total_weight_bytes
    k = cfg["num_experts_per_tok"]
    moe_layers = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 0)
    distinct = e * (1 - (1 - k / e) ** bs)
    eb = expert_bytes(cfg, elem)
    return total_weight_bytes - moe_layers * e * eb + int(moe_layers * distinct * eb)


def roofline(step_weight_bytes: int, kv_bytes_per_token: int, bs: int, ctx: int) -> dict:
    """tok/s if a decode step read its weights once and each sequence's ``ctx`` tokens of KV."""
    step = step_weight_bytes + bs * ctx * kv_bytes_per_token
    return {"step_bytes": step, "roofline_tok_s": bs / (step / HBM_BPS)}
