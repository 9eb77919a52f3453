"""ModelArchConfig: the architecture facts HiCache needs, parsed from an HF ``config.json``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from hicache.tiers.device import KVLayout


@dataclass(frozen=True)
class RopeScaling:
    """A non-default RoPE variant (``rope_type`` is one of ``serving.models.rope.ROPE_TYPES``)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    # yarn: the ramp's rotation bounds, whether they are rounded out, and the cos/sin scale (None: from
    # factor, or mscale / mscale_all_dim)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclass(frozen=True)
class RopeParams:
    """One layer type's rotary embedding: its base and its scaling (None: plain RoPE)."""

    theta: float
    scaling: RopeScaling | None = None


@dataclass(frozen=True)
class ModelArchConfig:
    """Architecture of a Llama-family decoder (Llama, Mistral, Qwen2)."""

    architectures: tuple[str, ...]
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Llama: bias on q/k/v/o; Qwen2 ignores it (always q/k/v bias)
    mlp_bias: bool
    eos_token_id: tuple[int, ...]
    bos_token_id: int | None
    # transformers 5's rope_parameters with a dict per layer type (Gemma-3: sliding_attention and
    # full_attention each their own base and scaling); rope_theta / rope_scaling are then full_attention's
    rope_by_layer_type: tuple[tuple[str, RopeParams], ...] = ()
    # the whole config.json (read-only): a family's own fields (layer types, windows, state sizes)
    # are read by its model class, not parsed here
    raw: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), compare=False, repr=False)

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> ModelArchConfig:
        """Parse an HF config dict (transformers 4 or 5 style)."""
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        by_type = _parse_rope_by_layer_type(raw)
        theta, scaling = _parse_rope(raw) if not by_type else _full_rope(by_type)
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
        bos = raw.get("bos_token_id")
        return ModelArchConfig(
            architectures=tuple(raw.get("architectures") or ()),
            model_type=str(raw.get("model_type", "")),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=_num_layers(raw),
            num_attention_heads=heads,
            # MLA (DeepSeek): the cached latent is one kv head, shared by every q head (and TP rank)
            num_key_value_heads=1 if _is_mla(raw) else int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            eos_token_id=eos_ids,
            bos_token_id=None if bos is None else int(bos),
            rope_by_layer_type=tuple(by_type.items()),
            raw=MappingProxyType(dict(raw)),
        )

    @staticmethod
    def from_pretrained(
        model_path: str | Path, overrides: Mapping[str, Any] | None = None
    ) -> ModelArchConfig:
        """Read ``model_path/config.json``; ``overrides`` replace raw keys before parsing."""
        raw = json.loads((Path(model_path) / "config.json").read_text())
        raw.update(overrides or {})
        return ModelArchConfig.from_dict(raw)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def for_layer_type(self, layer_type: str) -> ModelArchConfig:
        """This config with ``rope_theta`` / ``rope_scaling`` those of ``layer_type``'s layers
        (itself when the rope parameters are not per layer type)."""
        by_type = dict(self.rope_by_layer_type)
        params = by_type.get(layer_type)
        if params is None:
            if by_type:
                raise ValueError(f"rope_parameters has no {layer_type!r} entry: {sorted(by_type)}")
            return self
        return replace(self, rope_theta=params.theta, rope_scaling=params.scaling)

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3: ``kv_lora_rank``): L1 caches the latent."""
        return _is_mla(self.raw)

    def kv_layout(self, dtype: torch.dtype, num_layers: int | None = None, kv_heads: int | None = None) -> KVLayout:
        """The KV-cache layout of this model for a cache of ``dtype`` (``num_layers`` KV layers, ``kv_heads``
        a rank's kv heads; default: all). MLA: the latent, ``kv_lora_rank + qk_rope_head_dim`` per token."""
        n = self.num_hidden_layers if num_layers is None else num_layers
        if self.is_mla:
            return KVLayout.latent(n, int(self.raw["kv_lora_rank"]) + int(self.raw["qk_rope_head_dim"]), dtype)
        return KVLayout(n, self.num_key_value_heads if kv_heads is None else kv_heads, self.head_dim, dtype)


def _is_mla(raw: Mapping[str, Any]) -> bool:
    return raw.get("kv_lora_rank") is not None and raw.get("qk_rope_head_dim") is not None


def _num_layers(raw: Mapping[str, Any]) -> int:
    """``num_hidden_layers``, or the length of the layer list when config.json has none (transformers
    5 saves Nemotron-H's ``layers_block_type`` without it)."""
    if "num_hidden_layers" in raw:
        return int(raw["num_hidden_layers"])
    layers = raw.get("layers_block_type") or raw.get("layer_types") or raw.get("hybrid_override_pattern")
    if not layers:
        raise ValueError("config.json has neither num_hidden_layers nor a list of layer types")
    return len(layers)


def _parse_rope_by_layer_type(raw: Mapping[str, Any]) -> dict[str, RopeParams]:
    """``rope_parameters`` as a dict per layer type (transformers 5, e.g. Gemma-3), each parsed as a
    whole model's would be; {} when they are one model-wide dict (or absent)."""
    params = raw.get("rope_parameters") or {}
    if not params or not all(isinstance(v, Mapping) for v in params.values()):
        return {}
    out = {}
    for layer_type, p in params.items():
        theta, scaling = _parse_rope({"max_position_embeddings": raw.get("max_position_embeddings"),
                                      "rope_parameters": dict(p)})
        out[str(layer_type)] = RopeParams(theta, scaling)
    return out


def _full_rope(by_type: Mapping[str, RopeParams]) -> tuple[float, RopeScaling | None]:
    """The model-wide fields of a per-layer-type config: the full-attention layers' (else the first type's)."""
    p = by_type.get("full_attention") or next(iter(by_type.values()))
    return p.theta, p.scaling


def _parse_rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling`` keys."""
    params = raw.get("rope_parameters") or {}
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return theta, None
    orig = merged.get("original_max_position_embeddings")
    if rope_type == "llama3" and orig is None:
        orig = raw.get("max_position_embeddings")
    if rope_type == "yarn" and orig is None:
        orig = raw.get("max_position_embeddings")
    return theta, RopeScaling(
        rope_type=str(rope_type),
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=merged.get("low_freq_factor"),
        high_freq_factor=merged.get("high_freq_factor"),
        original_max_position_embeddings=None if orig is None else int(orig),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        truncate=bool(merged.get("truncate", True)),
        attention_factor=merged.get("attention_factor"),
        mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"),
    )
