"""How a Llama-family model splits over tensor-parallel ranks (Megatron / SGLang style).

- q heads split evenly; kv heads split evenly, or each rank holds one kv head *replicated*
  when there are fewer kv heads than ranks (rank r holds kv head ``r * KH // tp``, which is the
  head its q heads attend to);
- QKV and gate/up are column-split (output rows), o_proj and down_proj row-split (input
  columns, one all-reduce each), embedding and LM head vocab-split (rows, padded to a multiple
  of the rank count).

:class:`ShardPlan` is pure arithmetic; ``narrow`` reads only a rank's part of a checkpoint
tensor (safetensors slices are read lazily, so no rank materialises the full model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class TPShapeError(ValueError):
    """The model cannot be split over this many ranks (named in the message)."""


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    num_heads: int  # per rank
    num_kv_heads: int  # per rank
    kv_head_start: int  # first global kv head of this rank
    head_dim: int
    intermediate: int  # per rank
    vocab: int  # global
    vocab_per_rank: int  # padded

    @staticmethod
    def for_model(cfg: Any, rank: int = 0, size: int = 1) -> ShardPlan:
        """``cfg``: a ModelArchConfig. Raises TPShapeError when ``size`` does not divide the heads."""
        h, kh, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
        if h % size:
            raise TPShapeError(f"--tp-size {size} does not divide the model's {h} attention heads")
        if kh % size and size % kh:
            raise TPShapeError(
                f"--tp-size {size} and the model's {kh} kv heads: one must divide the other")
        if inter % size:
            raise TPShapeError(f"--tp-size {size} does not divide the model's intermediate size {inter}")
        if kh >= size:
            kv_local, kv_start = kh // size, rank * (kh // size)
        else:  # fewer kv heads than ranks: replicated, each rank the head of its q heads
            kv_local, kv_start = 1, rank * kh // size
        return ShardPlan(rank, size, h // size, kv_local, kv_start, cfg.head_dim, inter // size,
                         cfg.vocab_size, -(-cfg.vocab_size // size))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_valid(self) -> int:
        """Real (unpadded) vocab rows on this rank."""
        return max(0, min(self.vocab, self.vocab_start + self.vocab_per_rank) - self.vocab_start)

    def source_range(self, hf_piece: str, param: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of this rank's part of an HF tensor, or None for all of it.

        ``hf_piece``: q_proj k_proj v_proj gate_proj up_proj o_proj down_proj embed_tokens
        lm_head (or anything else: replicated); ``param``: "weight" or "bias".
        """
        if self.size == 1:
            return None
        if hf_piece == "q_proj":
            return 0, self.rank * self.q_size, self.q_size
        if hf_piece in ("k_proj", "v_proj"):
            return 0, self.kv_head_start * self.head_dim, self.kv_size
        if hf_piece in ("gate_proj", "up_proj"):
            return 0, self.rank * self.intermediate, self.intermediate
        if hf_piece in ("o_proj", "down_proj"):  # row-parallel: input columns; the bias is added once
            if param != "weight":
                return None
            width = self.q_size if hf_piece == "o_proj" else self.intermediate
            return 1, self.rank * width, width
        if hf_piece in ("embed_tokens", "lm_head"):
            return 0, self.vocab_start, self.vocab_valid
        return None


def narrow(src: Any, rng: tuple[int, int, int] | None) -> torch.Tensor:
    """``src`` (a tensor, or a lazy safetensors slice) restricted to ``rng`` (see source_range)."""
    if isinstance(src, torch.Tensor):
        return src if rng is None else src.narrow(*rng)
    if rng is None:
        return src[:]
    dim, start, length = rng
    index = [slice(None)] * len(src.get_shape())
    index[dim] = slice(start, start + length)
    return src[tuple(index)]
