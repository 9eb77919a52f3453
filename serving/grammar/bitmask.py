"""Token bitmasks as both grammar backends lay them out: int32 words, bit ``i`` of word ``j``
allows token ``32 * j + i`` (xgrammar's and llguidance's layout)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def bit_count(row: torch.Tensor) -> int:
    """How many tokens a (short) bitmask row allows."""
    return sum(int(w).bit_count() for w in row.numpy().view(np.uint32))


def single_set_bit(row: torch.Tensor, vocab_size: int) -> int | None:
    """The one token a bitmask row allows, or None when it allows zero or several."""
    words = row.numpy().view(np.uint32)
    nz = np.flatnonzero(words)
    if len(nz) != 1:
        return None
    w = int(words[nz[0]])
    if w & (w - 1):
        return None
    tok = int(nz[0]) * 32 + w.bit_length() - 1
    return tok if tok < vocab_size else None


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: Sequence[int], vocab_size: int) -> None:
    """Set ``logits[r, t]`` to -inf for every token ``t`` row ``r`` of ``mask`` disallows (only
    ``rows``; tokens past ``vocab_size`` or past the mask's width are disallowed), in place."""
    if not rows:
        return
    idx = torch.tensor(list(rows), device=logits.device)
    words = mask[torch.tensor(list(rows))].to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # [R, 32 * words]
    width = logits.shape[1]
    keep = torch.zeros(len(rows), width, dtype=torch.bool, device=logits.device)
    n = min(width, vocab_size, allowed.shape[1])
    keep[:, :n] = allowed[:, :n]
    logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))
