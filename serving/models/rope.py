"""Rotary position embedding (HF ``rotate_half`` convention) with the common scaling variants."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from serving.models.arch_config import ModelArchConfig, RopeScaling

InvFreqFn = Callable[[torch.Tensor, RopeScaling, ModelArchConfig], torch.Tensor]


def _linear(inv_freq: torch.Tensor, s: RopeScaling, cfg: ModelArchConfig) -> torch.Tensor:
    """Position interpolation: every frequency divided by ``factor``."""
    return inv_freq / s.factor


def _dynamic(inv_freq: torch.Tensor, s: RopeScaling, cfg: ModelArchConfig) -> torch.Tensor:
    """Dynamic NTK with the base stretched for the full ``factor * max_position_embeddings`` context.

    HF recomputes the base per batch from the current sequence length; a paged cache needs one
    fixed rotation per position, so (like other serving engines) we use the largest length.
    """
    dim = cfg.head_dim
    length = s.factor * cfg.max_position_embeddings
    base = cfg.rope_theta * ((s.factor * length / cfg.max_position_embeddings) - (s.factor - 1)) ** (
        dim / (dim - 2)
    )
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: RopeScaling, cfg: ModelArchConfig) -> torch.Tensor:
    """Llama 3.1: low frequencies divided by ``factor``, high kept, a smooth ramp between."""
    if s.low_freq_factor is None or s.high_freq_factor is None or s.original_max_position_embeddings is None:
        raise ValueError(
            "llama3 rope_scaling needs low_freq_factor, high_freq_factor, original_max_position_embeddings"
        )
    old_len = s.original_max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, s: RopeScaling, cfg: ModelArchConfig) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context are
    divided by ``factor``, those turning more than ``beta_fast`` times kept, a linear ramp between
    (over the frequency index; its ends rounded out with ``truncate``). The cos/sin scale is
    :func:`attention_factor`."""
    dim, base = cfg.head_dim, cfg.rope_theta
    orig = s.original_max_position_embeddings or cfg.max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(cfg: ModelArchConfig) -> float:
    """The factor cos and sin are scaled by: YaRN's ``attention_factor`` (given, else from ``factor``
    and ``mscale`` / ``mscale_all_dim`` as HF computes it); 1 for the other variants."""
    s = cfg.rope_scaling
    if s is None or s.rope_type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.mscale and s.mscale_all_dim:
        return _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return _yarn_mscale(s.factor)


ROPE_TYPES: dict[str, InvFreqFn] = {"linear": _linear, "dynamic": _dynamic, "llama3": _llama3, "yarn": _yarn}


def inv_frequencies(cfg: ModelArchConfig) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies of ``cfg`` (on the CPU)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_scaling is None:
        return inv_freq
    fn = ROPE_TYPES.get(cfg.rope_scaling.rope_type)
    if fn is None:
        raise ValueError(
            f"unsupported rope_scaling type {cfg.rope_scaling.rope_type!r}; supported: {sorted(ROPE_TYPES)}"
        )
    return fn(inv_freq, cfg.rope_scaling, cfg)


class RotaryEmbedding:
    """cos/sin tables ``[max_len, head_dim]`` (float32), grown on demand, one per device.

    Not an ``nn.Module``: it holds no parameters and builds its tables on the device of the
    positions it is asked for, so a model built on the meta device needs nothing special.
    """

    def __init__(self, cfg: ModelArchConfig) -> None:
        with torch.device("cpu"):  # also when the model is built under a meta-device context
            self.inv_freq = inv_frequencies(cfg)
        self.scale = attention_factor(cfg)  # cos and sin are multiplied by it (YaRN)
        self.initial_len = cfg.max_position_embeddings
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _build(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(length, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, self.inv_freq.to(device))  # [L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
        if self.scale == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.scale, emb.sin() * self.scale

    def tables(self, device: torch.device, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole ``[L >= max_len, D]`` float32 cos and sin tables on ``device``."""
        table = self._tables.get(device)
        if table is None or table[0].shape[0] < max_len:
            length = max(max_len, self.initial_len, 2 * table[0].shape[0] if table is not None else 0)
            table = self._tables[device] = self._build(length, device)
        return table

    def built_tables(self) -> dict[torch.device, tuple[torch.Tensor, torch.Tensor]]:
        """The tables built so far, by device (a copy: a later regrowth does not change it)."""
        return dict(self._tables)

    def cos_sin(self, positions: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, D]`` cos and sin at ``positions``; ``max_len`` bounds them (host-known, no sync)."""
        cos, sin = self.tables(positions.device, max_len)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by ``cos``/``sin [T, 1, D]``; computed in float32."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)
