"""``--quantization int4`` straight from a GGUF's Q4_1 blocks (no float weights in between).

A folder converted by ``serving.convert`` names its GGUF source (``hicache_convert.json``). When
every projection there is Q4_1 -- blocks of 32 input channels, ``w = d * q + m`` with 4-bit ``q``
-- the int4 kernel takes the blocks as they are: codes, ``d`` and ``m``, the half floats exact.
Rows come back in HF order (the GGUF stores q/k rows permuted
for llama.cpp's rope: ``reverse_permute``), q/k/v and gate/up are stacked as the fused layers are.
The float weights converted from the same file give the same codes (tests/models/test_quant.py), so this
changes where the codes come from, not which they are; the scales are the file's own half floats
(the recovered ones can differ in the last bits, hence the L3 tag ``int4v3:gguf``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from serving.models.quant.gguf_index import read_tensors

BLOCK = 32
Q4_1_BYTES = 20  # d (f16), m (f16), 16 bytes of nibbles
GGUF_NAMES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate",
              "ffn_up": "up", "ffn_down": "down"}
FUSED = {"self_attn.qkv_proj": ("q", "k", "v"), "self_attn.o_proj": ("o",), "mlp.gate_up_proj": ("gate", "up"),
         "mlp.down_proj": ("down",)}


def gguf_source(model_path: Path) -> Path | None:
    """The GGUF file ``model_path`` was converted from, if it is still there."""
    try:
        marker = json.loads((model_path / "hicache_convert.json").read_text())
    except (OSError, ValueError):
        return None
    path = marker.get("source_path")
    if path and Path(path).is_file():
        return Path(path)
    from serving.convert import SMOLLM2_GGUF, smollm2_gguf_path

    if marker.get("source") == SMOLLM2_GGUF:
        try:
            return smollm2_gguf_path()
        except FileNotFoundError:
            return None
    return None


def decode_q4_1(data: np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes ``[N, K]`` int32 0..15, d ``[N, K/32]``, m ``[N, K/32]`` float32) of Q4_1 rows."""
    blocks = np.ascontiguousarray(data).reshape(data.shape[0], k // BLOCK, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(data.shape[0], k)  # low nibbles first
    return torch.from_numpy(codes.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(m)


def reverse_permute(n_rows: int, heads: int) -> torch.Tensor:
    """HF row i is GGUF row ``perm[i]`` (llama.cpp interleaves each head's rope halves)."""
    idx = np.arange(n_rows).reshape(heads, 2, n_rows // heads // 2).swapaxes(1, 2).reshape(-1)
    return torch.from_numpy(np.argsort(idx))


def int4_groups(gguf: Path, num_heads: int, num_kv_heads: int
                ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
    """{fused layer name (``model.layers.N.self_attn.qkv_proj``...): (codes ``[N, K]``, d, m
    ``[N, K/32]``)} from the file's Q4_1 projections; None if any projection is another type."""
    parts: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for t in read_tensors(gguf):
        pieces = t.name.split(".")  # blk.<layer>.<name>.weight
        if len(pieces) != 4 or pieces[0] != "blk" or pieces[2] not in GGUF_NAMES or pieces[3] != "weight":
            continue
        if t.type_name != "Q4_1":
            return None
        k = int(t.shape[0])
        codes, d, m = decode_q4_1(t.data, k)
        short = GGUF_NAMES[pieces[2]]
        if short in ("q", "k"):
            perm = reverse_permute(codes.shape[0], num_heads if short == "q" else num_kv_heads)
            codes, d, m = codes[perm], d[perm], m[perm]
        parts[(int(pieces[1]), short)] = (codes, d, m)
    out = {}
    for layer in sorted({i for i, _ in parts}):
        for fused, shorts in FUSED.items():
            got = [parts[(layer, s)] for s in shorts if (layer, s) in parts]
            if len(got) != len(shorts):
                return None
            codes = torch.cat([g[0] for g in got])
            out[f"model.layers.{layer}.{fused}"] = (codes, torch.cat([g[1] for g in got]),
                                                    torch.cat([g[2] for g in got]))
    return out or None
