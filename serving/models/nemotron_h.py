"""Nemotron-H (NVIDIA's Mamba2 hybrid): a stack of single-mixer blocks, ``h + mixer(norm(h))``, the
mixer one of Mamba2 (``M``), attention (``*``: GQA without positional encoding), a squared-ReLU MLP
(``-``) or a mixture of experts (``E``, refused this version).

The blocks come from ``hybrid_override_pattern`` (``"M-M-M*-..."``, the checkpoints on the Hub) or
transformers 5's ``layers_block_type`` list (``linear_attention`` = Mamba2, ``full_attention``,
``mlp``, ``moe``). KV goes to the KV pool's layer ``layer_stack.kv_index(i)``, Mamba state to the
state pool's layer ``state_index(i)``. Parameter names are HF's. Under tensor parallelism each rank
holds its heads (the attention's as Llama's, ShardPlan; Mamba2's heads and groups,
serving/parallel/state_shard.py), the MLP's columns and its vocab rows.
"""

from __future__ import annotations

import torch
from torch import nn

from hicache.tiers.device import DeviceKVPool
from hicache.tiers.state_pool import DeviceStatePool
from serving.kernels.attention_base import AttentionBackend
from serving.models.arch_config import ModelArchConfig
from serving.models.hybrid_parts import HybridCausalLM, activation
from serving.models.layer_spec import LayerKind, LayerSpec, LayerStack
from serving.models.llama import RMSNorm
from serving.models.mamba2 import Mamba2Mixer
from serving.models.registry import register_model
from serving.parallel.group import TPGroup
from serving.parallel.layers import RowParallelLinear, VocabParallelEmbedding
from serving.parallel.shard import ShardPlan
from serving.parallel.state_shard import Mamba2Shard
from serving.structs.forward_batch import ForwardBatch

_PATTERN = {"M": LayerKind.MAMBA, "*": LayerKind.FULL, "-": LayerKind.MLP}
_TYPES = {"linear_attention": LayerKind.MAMBA, "mamba": LayerKind.MAMBA, "full_attention": LayerKind.FULL,
          "attention": LayerKind.FULL, "mlp": LayerKind.MLP}


def nemotron_h_stack(cfg: ModelArchConfig) -> LayerStack:
    raw = cfg.raw
    types = raw.get("layers_block_type") or raw.get("layer_types")
    if types:
        names, table = list(types), _TYPES
    else:
        names, table = list(str(raw.get("hybrid_override_pattern") or "")), _PATTERN
    if not names:
        raise ValueError("Nemotron-H config.json has neither hybrid_override_pattern nor layers_block_type")
    moe = [i for i, n in enumerate(names) if n in ("E", "moe")]
    if moe:
        raise ValueError(f"Nemotron-H mixture-of-experts blocks (layers {moe}) are not supported yet; "
                         f"dense checkpoints (Mamba2, attention and MLP blocks only) are")
    bad = sorted({n for n in names if n not in table})
    if bad:
        raise ValueError(f"unknown Nemotron-H block types {bad}")
    if len(names) != cfg.num_hidden_layers:
        raise ValueError(f"{len(names)} Nemotron-H blocks for num_hidden_layers {cfg.num_hidden_layers}")
    return LayerStack(tuple(LayerSpec(table[n]) for n in names))


class Attention(nn.Module):
    """HF ``NemotronHAttention``: GQA, no rope, no biases; this rank's heads (``plan``)."""

    def __init__(self, cfg: ModelArchConfig, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        h, kh, d = plan.num_heads, plan.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kh, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kh * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kh * d, bias=False)
        self.o_proj = RowParallelLinear(h * d, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(t, self.num_heads, d)
        k = self.k_proj(x).view(t, self.num_kv_heads, d)
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        attn.store_kv(k_cache, v_cache, batch.out_cache_loc, k, v)
        return self.o_proj(attn.forward(q, k_cache, v_cache, batch, d**-0.5).reshape(t, self.num_heads * d))


class MLP(nn.Module):
    """HF ``NemotronHMLP``: ``down(act(up(x)))``, act ``mlp_hidden_act`` (relu2)."""

    def __init__(self, cfg: ModelArchConfig, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, plan.intermediate, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(plan.intermediate, cfg.hidden_size, cfg.mlp_bias, tp)
        self.act = activation(str(cfg.raw.get("mlp_hidden_act", "relu2")), "MLP")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


def _mamba_dims(cfg: ModelArchConfig) -> dict[str, int]:
    raw = cfg.raw
    return {"num_heads": int(raw["mamba_num_heads"]), "head_dim": int(raw["mamba_head_dim"]),
            "state_size": int(raw["ssm_state_size"]),
            "n_groups": int(raw.get("n_groups", raw.get("mamba_n_groups", 1)))}


def _mamba(cfg: ModelArchConfig, eps: float, tp: TPGroup) -> Mamba2Mixer:
    raw = cfg.raw
    return Mamba2Mixer(
        cfg.hidden_size, **_mamba_dims(cfg), conv_kernel=int(raw.get("conv_kernel", raw.get("mamba_d_conv", 4))),
        eps=eps, conv_bias=bool(raw.get("use_conv_bias", raw.get("mamba_conv_bias", True))),
        proj_bias=bool(raw.get("use_bias", False)), time_step_min=float(raw.get("time_step_min", 0.001)),
        act=str(raw.get("mamba_hidden_act", "silu")), tp=tp)


class Block(nn.Module):
    def __init__(self, cfg: ModelArchConfig, kind: LayerKind, eps: float, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, eps)
        self.mixer = (_mamba(cfg, eps, tp) if kind is LayerKind.MAMBA
                      else Attention(cfg, plan, tp) if kind is LayerKind.FULL else MLP(cfg, plan, tp))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelArchConfig, stack: LayerStack, eps: float, plan: ShardPlan, tp: TPGroup) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(plan, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(Block(cfg, s.kind, eps, plan, tp) for s in stack.specs)
        self.norm_f = RMSNorm(cfg.hidden_size, eps)


@register_model("NemotronHForCausalLM")
class NemotronHForCausalLM(HybridCausalLM):
    """Causal LM returning float32 logits of each sequence's last new token."""

    prefix_aliases = {"backbone.": "model."}
    state_kind = "Mamba2"

    def __init__(self, cfg: ModelArchConfig, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, tp, "Nemotron-H")
        self.layer_stack = nemotron_h_stack(cfg)
        eps = float(cfg.raw.get("layer_norm_epsilon", cfg.rms_norm_eps))
        self.model = Backbone(cfg, self.layer_stack, eps, self.plan, self.tp)
        self.conv_kernel = int(cfg.raw.get("conv_kernel", cfg.raw.get("mamba_d_conv", 4)))

    @staticmethod
    def check_tp(cfg: ModelArchConfig, size: int) -> None:
        """TPShapeError when ``size`` ranks cannot split the Mamba2 heads and groups (before any rank starts)."""
        m = _mamba_dims(cfg)
        Mamba2Shard.make(m["num_heads"], m["n_groups"], m["head_dim"], m["state_size"], 0, size)

    def mixer(self, layer: int) -> nn.Module:
        return self.model.layers[layer].mixer

    @property
    def embed(self) -> VocabParallelEmbedding:
        return self.model.embeddings

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: DeviceKVPool, attn: AttentionBackend,
                state: DeviceStatePool | None = None) -> torch.Tensor:
        """Each block: its norm, then its one mixer (Mamba2, attention or MLP) as a residual."""
        stack = self.layer_stack
        plan = self.begin_forward(batch, attn, state)
        h = self.model.embeddings(batch.input_ids)
        waits = batch.layer_waits
        kv_i = state_i = 0
        for block, spec in zip(self.model.layers, stack.specs, strict=True):
            x = block.norm(h)
            if spec.kind is LayerKind.MAMBA:
                conv, rec = state.layer(state_i)
                h = h + block.mixer(x, plan, conv, rec)
                state_i += 1
            elif spec.kind is LayerKind.FULL:
                if waits is not None:
                    waits.before_layer(kv_i)
                h = h + block.mixer(x, batch, kv.k_buffers[kv_i], kv.v_buffers[kv_i], attn)
                kv_i += 1
            else:
                h = h + block.mixer(x)
        return self.last_logits(h, batch, self.model.norm_f)
