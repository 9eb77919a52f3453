"""Model shapes and the byte arithmetic of bench/hybrid.py: configs, rooflines, tokens per GB."""

from __future__ import annotations

import json
import os

import torch

HBM_BPS = 4.1e12  # the H200's HBM bandwidth the issue's rooflines use

# Gemma-3 12B's text model (google/gemma-3-12b: MaxText's gemma3-12b config and HF's config.json):
# 48 layers, hidden 3840, MLP 15360, 16 heads, 8 KV heads of 256, window 1024, 5 sliding : 1 full.
GEMMA3_12B = {"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 1024, "query_pre_attn_scalar": 256,
              "vocab_size": 262208, "rope_parameters": {
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                  "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}}


def qwen3_5_config(small: bool) -> dict:
    """Qwen3.5's default text config from transformers (the 9B-class shape), or a 4-layer smoke shape."""
    from transformers import Qwen3_5TextConfig

    kw = {} if not small else dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                                   vocab_size=32000)
    cfg = Qwen3_5TextConfig(**kw).to_dict()
    cfg["architectures"] = ["Qwen3_5ForCausalLM"]
    return cfg


def gemma3_config(small: bool) -> dict:
    from transformers import Gemma3TextConfig

    kw = dict(GEMMA3_12B)
    if small:
        kw.update(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, sliding_window=128, query_pre_attn_scalar=64, vocab_size=32000)
    cfg = Gemma3TextConfig(**kw).to_dict()
    cfg["architectures"] = ["Gemma3ForCausalLM"]
    return cfg


def write_model_dir(path: str, cfg: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def layer_bytes(model, cfg: dict) -> dict:
    """Bytes of what a step reads, per kind: KV per token and layer, state per sequence and layer."""
    stack = model.layer_stack
    kv_tok_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2  # K and V, bf16
    state = model.state_layout(torch.bfloat16) if stack.state_layers else None
    snap = state.bytes_per_slot() if state is not None else 0
    windows = list(stack.windows)  # per KV layer
    return {"kv_tok_layer": kv_tok_layer, "kv_layers": len(stack.kv_layers), "state_layers": len(stack.state_layers),
            "windows": [w for w in windows if w is not None],
            "full_kv_layers": sum(1 for w in windows if w is None), "snapshot_bytes": snap,
            "num_layers": len(stack.specs)}


def weight_bytes(model) -> int:
    """Parameter bytes one decode step reads: every weight, the embedding as the LM head only
    (a lookup reads B rows; a tied model's embedding is the head)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied head counts once
    emb = next(p for n, p in model.named_parameters() if n.endswith("embed_tokens.weight"))
    tied = not any(p.data_ptr() != emb.data_ptr() and n.endswith("lm_head.weight")
                   for n, p in model.named_parameters())
    return total if tied else total - emb.numel() * emb.element_size()


def decode_roofline(wbytes: int, lb: dict, bs: int, ctx: int) -> dict:
    """tok/s if a step read its bytes once at HBM_BPS: weights + each sequence's KV (a window
    layer reads its window) + its state read and written."""
    kv = lb["full_kv_layers"] * ctx + sum(min(w, ctx) for w in lb["windows"])
    per_seq = kv * lb["kv_tok_layer"] + 2 * lb["snapshot_bytes"]
    step_bytes = wbytes + bs * per_seq
    return {"step_bytes": step_bytes, "roofline_tok_s": bs / (step_bytes / HBM_BPS)}


def tokens_per_gb(lb: dict, seq_len: int, snapshots_now: int, l1_window_share: float = 1.0,
                  l2_window_share: float = 1.0) -> dict:
    """Cached tokens per GB for sequences of ``seq_len`` tokens: today's L1 (full layers every token;
    window layers every token, or with a hybrid SWA L1 ``l1_window_share`` = its window pages per
    logical page; ``snapshots_now`` state snapshots per sequence end) and L2 (likewise: window layers
    every token, or with its host window pool ``l2_window_share`` = host window pages per L2 page),
    what the layer mix allows (full layers every token, window layers one window, one snapshot per end),
    and the all-full-attention model."""
    kvt, full, win = lb["kv_tok_layer"], lb["full_kv_layers"], lb["kv_layers"] - lb["full_kv_layers"]
    snaps = snapshots_now * lb["snapshot_bytes"]
    l1 = seq_len * (full + win * l1_window_share) * kvt + snaps
    l2 = seq_len * (full + win * l2_window_share) * kvt + snaps
    mix = (seq_len * full * kvt + sum(min(w, seq_len) for w in lb["windows"]) * kvt + lb["snapshot_bytes"])
    allfull = seq_len * lb["num_layers"] * kvt  # every layer full attention, the same attention shape
    per_gb = {k: seq_len / (v / 1e9) for k, v in (("l1", l1), ("l2", l2), ("layer_mix", mix), ("all_full", allfull))}
    return {"seq_len": seq_len, "l1_window_share": l1_window_share, "l2_window_share": l2_window_share,
            "tokens_per_gb_now": per_gb["l1"], "tokens_per_gb_now_l2": per_gb["l2"],
            "tokens_per_gb_layer_mix": per_gb["layer_mix"], "tokens_per_gb_all_full": per_gb["all_full"],
            "now_vs_all_full": per_gb["l1"] / per_gb["all_full"],
            "layer_mix_vs_all_full": per_gb["layer_mix"] / per_gb["all_full"],
            "now_vs_layer_mix": per_gb["l1"] / per_gb["layer_mix"],
            "now_l2_vs_layer_mix": per_gb["l2"] / per_gb["layer_mix"], "snapshots_per_end_now": snapshots_now}
