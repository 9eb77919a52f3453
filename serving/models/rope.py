"""Rotary position embedding (HF ``rotate_half`` convention) with the common scaling variants."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from serving.models.config import ModelArchConfig, RopeScaling

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


ROPE_TYPES: dict[str, InvFreqFn] = {"linear": _linear, "dynamic": _dynamic, "llama3": _llama3}


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
        self.initial_len = cfg.max_position_embeddings
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _build(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(length, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, self.inv_freq.to(device))  # [L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
        return emb.cos(), emb.sin()

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
