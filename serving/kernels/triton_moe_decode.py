"""The mixture-of-experts of a few tokens (decode) on CUDA, in three launches after the router's GEMM:
routing, gate/up and down, with no alignment, no padding and no sum afterwards.

At batch 1 a Qwen3-30B-A3B layer reads 8 experts' 75 MB of weights: the step is bound by memory and by
the number of launches, not by arithmetic. The blocked kernels of ``serving.kernels.triton_moe`` spend
four launches before their GEMMs (softmax, top-k, renormalize and cast, the alignment into 16-row
blocks), pad each expert's one row to 16 and sum the top-k rows in a launch of their own. Here:

1. **route** (:func:`route_topk`; one program per token): the router's logits ``[T, E]`` to the top-k
   experts and their weights, as ``moe.py``'s ``softmax_topk`` (softmax over every expert in float32,
   the top k, with ``renormalize`` rescaled to sum to 1) or ``topk_softmax`` (the top k logits, a
   softmax over those), rounded to the activations' dtype as HF rounds them;
2. **gate/up** (one program per (token, choice) pair and tile of ``BLOCK_N`` columns): a matrix-vector
   product of the token's hidden row with its expert's gate and up rows, plus their bias, activated
   (the ``ACTIVATIONS`` of ``triton_moe``), into ``act [T * k, I]`` (float32);
3. **down** (one program per token and tile of output columns): for each of the token's k choices its
   expert's down rows times ``act``'s row, plus its bias, times its routing weight, summed in float32
   and rounded once into ``out [T, H]``.

Each (token, choice) pair reads its expert's weights, so a weight read twice is read twice: this path
is for batches where the pairs are few against the experts (:func:`use_decode_path`); the blocked
kernels read each expert once per block of rows. Nothing is read back to the host (a CUDA graph holds
it); sizes depend on ``T``, ``k``, ``E``, ``H``, ``I`` only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.kernels.triton_common import next_pow2
from serving.kernels.triton_moe import ACTIVATIONS, activate, moe_shapes

SCORINGS = {"softmax_topk": 0, "topk_softmax": 1}  # moe.py's scorings this router kernel computes
# tiles and warps: the best of a sweep on the H200 at Qwen3-30B-A3B's shape, 1 and 4 tokens
# (bench/results/diag/moe-decode-prof-h200-2026-12-05.json: gate/up 13.6 / 43.4 us, down 11.0 / 25.3 us)
BLOCK_N_UP, BLOCK_N_DOWN, BLOCK_K, WARPS = 8, 16, 256, 8


def use_decode_path(tokens: int, top_k: int, experts: int) -> bool:
    """The matrix-vector kernels while the pairs are at most a quarter of the experts (each pair then
    mostly has an expert of its own); the blocked kernels above. A function of the shapes only."""
    return tokens * top_k * 4 <= experts


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l,
                  K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, SCORING: tl.constexpr,
                  RENORM: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, E_P2)
    valid = offs < E
    raw = tl.load(logits_ptr + t.to(tl.int64) * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    if SCORING == 0:  # softmax over every expert first
        m = tl.max(raw, axis=0)
        p = tl.exp(raw - m)
        p = tl.where(valid, p, 0.0)
        score = p / tl.sum(p, axis=0)
        score = tl.where(valid, score, -1.0)
    else:
        score = raw
    ks = tl.arange(0, K_P2)
    kept = ks < K
    top = tl.zeros((K_P2,), tl.float32)
    idx = tl.zeros((K_P2,), tl.int32)
    for j in tl.static_range(K):  # the k best, the lowest index first among equals
        best = tl.max(score, axis=0)
        at = tl.min(tl.where(score == best, offs, E_P2), axis=0)
        top = tl.where(ks == j, best, top)
        idx = tl.where(ks == j, at, idx)
        score = tl.where(offs == at, float("-inf"), score)
    if SCORING == 1:  # a softmax over the k kept logits
        e = tl.where(kept, tl.exp(top - tl.max(tl.where(kept, top, float("-inf")), axis=0)), 0.0)
        top = e / tl.sum(e, axis=0)
    elif RENORM:
        top = top / tl.sum(top, axis=0)
    tl.store(w_ptr + t * K + ks, top.to(w_ptr.dtype.element_ty), mask=kept)
    tl.store(ids_ptr + t * K + ks, idx, mask=kept)


def route_topk(logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in dtype, ids [T, k] int32)`` of router logits ``[T, E]`` (module docstring)."""
    if scoring not in SCORINGS:
        raise ValueError(f"the routing kernel has no scoring {scoring!r}; it has {sorted(SCORINGS)}")
    tokens, experts = logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k {top_k} of {experts} experts")
    weights = torch.empty((tokens, top_k), dtype=dtype, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    if tokens:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _route_kernel[(tokens,)](
            logits, weights, ids, experts, logits.stride(0), K=top_k, K_P2=next_pow2(top_k),
            E_P2=next_pow2(experts, 16), SCORING=SCORINGS[scoring], RENORM=renormalize, num_warps=4,
        )  # fmt: skip
    return weights, ids


@triton.jit
def _up_gemv_kernel(x_ptr, w_ptr, b_ptr, act_ptr, ids_ptr, H, INTER,
                    stride_x, stride_we, stride_wn, stride_be, stride_act, alpha, limit,
                    TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pair = tl.program_id(0)
    tok = (pair // TOP_K).to(tl.int64)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    kk = tl.arange(0, BLOCK_K)
    w_e = w_ptr + e * stride_we
    acc_g = tl.zeros((BLOCK_N,), tl.float32)
    acc_u = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        k_ok = k < H
        a = tl.load(x_ptr + tok * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
        wmask = col_ok[:, None] & k_ok[None, :]
        wg = tl.load(w_e + cols[:, None] * stride_wn + k[None, :], mask=wmask, other=0.0)  # [N, K]
        wu = tl.load(w_e + (INTER + cols)[:, None] * stride_wn + k[None, :], mask=wmask, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * a[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * a[None, :], axis=1)
    if HAS_BIAS:
        b_e = b_ptr + e * stride_be
        acc_g += tl.load(b_e + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc_u += tl.load(b_e + INTER + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = activate(acc_g, acc_u, alpha, limit, ACT)
    tl.store(act_ptr + pair.to(tl.int64) * stride_act + cols, out, mask=col_ok)


@triton.jit
def _down_gemv_kernel(a_ptr, w_ptr, b_ptr, topw_ptr, ids_ptr, out_ptr, H, INTER,
                      stride_a, stride_we, stride_wn, stride_be, stride_out,
                      TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    kk = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_N,), tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        w_e = w_ptr + e * stride_we
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            k = k0 + kk
            k_ok = k < INTER
            a = tl.load(a_ptr + pair.to(tl.int64) * stride_a + k, mask=k_ok, other=0.0)
            w = tl.load(w_e + cols[:, None] * stride_wn + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(b_ptr + e * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)
        total += acc * tl.load(topw_ptr + pair).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


def moe_decode(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k]
    ids: torch.Tensor,  # [T, k] int
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``, ``[T, H]`` in ``x``'s dtype (module docstring).
    ``tiles``: ``(BLOCK_N of gate/up, BLOCK_N of down, BLOCK_K)``, for sweeps."""
    tokens, hidden, top_k, _, inter = moe_shapes(x, ids, w13, w2, activation)
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = ids.reshape(-1).contiguous()
    topw = weights.reshape(-1).contiguous()
    bn_up, bn_dn, bk = tiles or (BLOCK_N_UP, BLOCK_N_DOWN, BLOCK_K)
    bk_up, bk_dn = min(bk, next_pow2(hidden, 16)), min(bk, next_pow2(inter, 16))
    act = torch.empty((tokens * top_k, inter), dtype=torch.float32, device=x.device)
    _up_gemv_kernel[(tokens * top_k, triton.cdiv(inter, bn_up))](
        x, w13, w13 if b13 is None else b13, act, ids, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), 0 if b13 is None else b13.stride(0), act.stride(0),
        float(alpha), float(limit), TOP_K=top_k, ACT=ACTIVATIONS[activation], HAS_BIAS=b13 is not None,
        BLOCK_N=bn_up, BLOCK_K=bk_up, num_warps=WARPS,
    )  # fmt: skip
    _down_gemv_kernel[(tokens, triton.cdiv(hidden, bn_dn))](
        act, w2, w2 if b2 is None else b2, topw, ids, out, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), 0 if b2 is None else b2.stride(0), out.stride(0),
        TOP_K=top_k, HAS_BIAS=b2 is not None, BLOCK_N=bn_dn, BLOCK_K=bk_dn, num_warps=WARPS,
    )  # fmt: skip
    return out
