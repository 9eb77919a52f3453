"""The attention kernels' test cases: ragged extend batches over a paged pool, a dense reference, a backend's run."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch

from serving.structs.forward_batch import ForwardBatch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The relative error of ``out`` against ``ref`` (Frobenius norms, in float64)."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@dataclass
class Case:
    batch: ForwardBatch
    q: torch.Tensor  # [T, H, D]
    k_new: torch.Tensor  # [T, KH, D]
    v_new: torch.Tensor
    k_cache: torch.Tensor  # [P, ps, KH, D], prefix KV already stored
    v_cache: torch.Tensor
    k_full: list[torch.Tensor]  # per sequence [L, KH, D] dense, for the reference
    v_full: list[torch.Tensor]


def make_case(
    lens: list[tuple[int, int]],
    page_size: int,
    heads: int = 4,
    kv_heads: int = 2,
    dim: int = 16,
    seed: int = 0,
) -> Case:
    """Sequences of ``(prefix_len, extend_len)``; prefix KV written into shuffled pages."""
    gen = torch.Generator().manual_seed(seed)
    pages_needed = [-(-(p + e) // page_size) for p, e in lens]
    num_pages = sum(pages_needed) + 3
    free = list(range(1, num_pages))
    random.Random(seed).shuffle(free)
    k_cache = torch.randn((num_pages, page_size, kv_heads, dim), generator=gen)  # garbage outside sequences
    v_cache = torch.randn((num_pages, page_size, kv_heads, dim), generator=gen)
    seqs, k_full, v_full = [], [], []
    for (prefix, n), npages in zip(lens, pages_needed, strict=True):
        pages = [free.pop() for _ in range(npages)]
        k = torch.randn((prefix + n, kv_heads, dim), generator=gen)
        v = torch.randn((prefix + n, kv_heads, dim), generator=gen)
        slots = torch.tensor([pages[i // page_size] * page_size + i % page_size for i in range(prefix)])
        k_cache.view(-1, kv_heads, dim)[slots.long()] = k[:prefix]
        v_cache.view(-1, kv_heads, dim)[slots.long()] = v[:prefix]
        seqs.append(([1] * n, prefix, pages))
        k_full.append(k)
        v_full.append(v)
    batch = ForwardBatch.build(seqs, page_size, device=DEVICE)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    k_full, v_full = [k.to(DEVICE) for k in k_full], [v.to(DEVICE) for v in v_full]
    k_new = torch.cat([k[p:] for k, (p, _) in zip(k_full, lens, strict=True)])
    v_new = torch.cat([v[p:] for v, (p, _) in zip(v_full, lens, strict=True)])
    q = torch.randn((batch.num_tokens, heads, dim), generator=gen).to(DEVICE)
    return Case(batch, q, k_new, v_new, k_cache, v_cache, k_full, v_full)


def dense_reference(case: Case, scale: float) -> torch.Tensor:
    """Causal attention on the dense per-sequence K/V (no pages involved)."""
    out, s = [], 0
    heads, kv_heads = case.q.shape[1], case.k_new.shape[1]
    for i, (prefix, n) in enumerate(
        zip(case.batch.prefix_lens_list, case.batch.extend_lens_list, strict=True)
    ):
        q = case.q[s : s + n]  # [n, H, D]
        k = case.k_full[i].repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        v = case.v_full[i].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
        visible = (
            torch.arange(prefix + n, device=q.device)[None, :]
            <= torch.arange(prefix, prefix + n, device=q.device)[:, None]
        )
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hnl,lhd->nhd", probs, v))
        s += n
    return torch.cat(out)


def run_backend(backend, case: Case, scale: float) -> torch.Tensor:  # noqa: ANN001
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    backend.store_kv(kc, vc, case.batch.out_cache_loc, case.k_new, case.v_new)
    return backend.forward(case.q, kc, vc, case.batch, scale)


EXTEND_CASES = {
    "no_prefix": [(0, 7), (0, 1), (0, 20)],
    "with_prefix": [(5, 3), (16, 9), (33, 2)],
    "mixed_ragged": [(0, 11), (9, 1), (4, 6), (21, 1), (0, 1)],
}
