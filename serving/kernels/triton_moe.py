"""A fused mixture-of-experts on CUDA (serving/models/moe.py's ``SparseMoE`` on the GPU), in three
launches plus a sum, none of which reads anything back to the host (a CUDA graph holds it):

1. **align** (:func:`align`; one program up to ``SINGLE_PROGRAM_ROWS`` rows, else one per chunk of
   rows with the experts' offsets summed in torch between two launches): the ``[T, k]`` expert ids into
   expert-contiguous blocks of ``block_m`` rows. Each expert's rows (flat ids ``t * k + j``, in token
   order) start at a multiple of ``block_m`` and are padded up to one; a padding slot holds
   ``N = T * k``, which no kernel reads or writes. ``block_expert[b]`` is block ``b``'s expert, ``E``
   for the blocks past the last expert's (they exit at once). The buffers' sizes depend on ``T``,
   ``k``, ``E`` and ``block_m`` only: the worst case ``N + min(E, N) * (block_m - 1)`` rows;
2. **gate/up** (a grouped GEMM over the blocks, ``w13 [E, 2I, H]``): each program computes a tile of
   gate columns and the matching up columns of one block's rows (the token's hidden row, gathered),
   adds the expert's bias (``b13``) when there is one and writes the activated product to ``act [N, I]``
   (float32 inside; the activations of ``ACTIVATIONS``: SwiGLU, GPT-OSS's clamped gate with alpha/limit);
3. **down** (``w2 [E, H, I]``): ``act``'s rows times the expert's down projection, plus its bias
   (``b2``), times the row's routing weight, into ``y [N, H]``; ``y.view(T, k, H).sum(1)`` is the output
   (the sum over the top-k in float32, rounded once).

Arithmetic: float32 accumulation (``tl.dot`` with IEEE inputs, as the attention kernels), the same
activation formulas as the torch path; it rounds less often than the torch path (gate/up and each
expert's product stay in float32), so the two agree to rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from serving.kernels.triton_common import next_pow2

ACTIVATIONS = {"silu": 0, "gpt_oss": 1}  # the kernel's ACT per moe.py activation
SINGLE_PROGRAM_ROWS = 1024  # align in one program up to this many rows (decode), in chunks above (prefill)


def pick_block_m(tokens: int, top_k: int, experts: int) -> int:
    """Rows per block: 16 while the experts get few rows each (decode), up to 64 for long prefills.
    A function of the shapes only, so a graph's size has one."""
    per_expert = tokens * top_k / experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def align_sizes(tokens: int, top_k: int, experts: int, block_m: int) -> tuple[int, int]:
    """(rows, blocks) of the aligned buffers: the worst case over any routing."""
    n = tokens * top_k
    rows = n + min(experts, n) * (block_m - 1)
    return rows, triton.cdiv(rows, block_m)


def moe_shapes(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               activation: str) -> tuple[int, int, int, int, int]:
    """``(tokens, hidden, top_k, experts, inter)`` of a fused MoE call, its activation and expert weights
    checked (ValueError naming what does not fit)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"the fused MoE kernel has no activation {activation!r}; it has {sorted(ACTIVATIONS)}")
    tokens, hidden = x.shape
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if w13.shape[2] != hidden or w2.shape != (experts, hidden, inter):
        raise ValueError(f"expert weights w13 {list(w13.shape)} / w2 {list(w2.shape)} do not fit hidden {hidden}")
    return tokens, hidden, ids.shape[1], experts, inter


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, N, num_blocks,
                  E: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  BB: tl.constexpr):
    experts = tl.arange(0, E_P2)
    counts = tl.zeros((E_P2,), tl.int32)
    for start in range(0, N, CHUNK):  # pass 1: each expert's row count
        offs = start + tl.arange(0, CHUNK)
        v = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
        counts += tl.sum((v[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    seen = tl.zeros((E_P2,), tl.int32)
    for start in range(0, N, CHUNK):  # pass 2: each row's slot = its expert's start + its rank there
        offs = start + tl.arange(0, CHUNK)
        v = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
        hit = (v[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_P2]
        rank = tl.cumsum(hit, 0) - 1 + seen[None, :]
        pos = tl.sum(hit * (starts[None, :] + rank), 1)
        tl.store(sorted_ptr + pos, offs, mask=offs < N)
        seen += tl.sum(hit, 0)
    for b0 in range(0, num_blocks, BB):  # a block's expert: the experts that end at or before its first row
        blocks = b0 + tl.arange(0, BB)
        first = blocks * BLOCK_M
        before = (ends[None, :] <= first[:, None]) & (experts[None, :] < E)
        tl.store(block_expert_ptr + blocks, tl.sum(before.to(tl.int32), 1), mask=blocks < num_blocks)


@triton.jit
def _chunk_count_kernel(ids_ptr, chunk_counts_ptr, N, E: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    experts = tl.arange(0, E_P2)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
    hit = (v[:, None] == experts[None, :]).to(tl.int32)
    tl.store(chunk_counts_ptr + c * E + experts, tl.sum(hit, 0), mask=experts < E)


@triton.jit
def _chunk_place_kernel(ids_ptr, base_ptr, sorted_ptr, N, E: tl.constexpr, E_P2: tl.constexpr,
                        CHUNK: tl.constexpr):
    c = tl.program_id(0)
    experts = tl.arange(0, E_P2)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
    hit = (v[:, None] == experts[None, :]).to(tl.int32)
    base = tl.load(base_ptr + c * E + experts, mask=experts < E, other=0)  # expert start + earlier chunks' rows
    pos = tl.sum(hit * (tl.cumsum(hit, 0) - 1 + base[None, :]), 1)
    tl.store(sorted_ptr + pos, offs, mask=offs < N)


def align(ids: torch.Tensor, experts: int, block_m: int,
          single: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_ids [rows] int32, block_expert [blocks] int32)`` of ``ids [T, k]`` (module docstring).
    ``single``: one program (default up to ``SINGLE_PROGRAM_ROWS`` rows) or one per chunk."""
    tokens, top_k = ids.shape
    n = tokens * top_k
    rows, blocks = align_sizes(tokens, top_k, experts, block_m)
    sorted_ids = torch.full((rows,), n, dtype=torch.int32, device=ids.device)
    flat = ids.reshape(-1)
    e_p2 = next_pow2(experts, 2)
    if n <= SINGLE_PROGRAM_ROWS if single is None else single:
        block_expert = torch.empty((blocks,), dtype=torch.int32, device=ids.device)
        _align_kernel[(1,)](
            flat, sorted_ids, block_expert, n, blocks, E=experts, E_P2=e_p2, BLOCK_M=block_m,
            CHUNK=max(16, min(1024, 16384 // e_p2)), BB=max(16, min(1024, 16384 // e_p2)), num_warps=8,
        )  # fmt: skip
        return sorted_ids, block_expert
    chunk = max(16, min(256, 4096 // e_p2))
    chunks = triton.cdiv(n, chunk)
    chunk_counts = torch.empty((chunks, experts), dtype=torch.int32, device=ids.device)
    _chunk_count_kernel[(chunks,)](flat, chunk_counts, n, E=experts, E_P2=e_p2, CHUNK=chunk, num_warps=4)
    padded = (chunk_counts.sum(0) + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # [E] int64
    base = (chunk_counts.cumsum(0) - chunk_counts + (ends - padded)).to(torch.int32)  # [chunks, E]
    _chunk_place_kernel[(chunks,)](flat, base, sorted_ids, n, E=experts, E_P2=e_p2, CHUNK=chunk, num_warps=4)
    firsts = torch.arange(blocks, dtype=ends.dtype, device=ids.device) * block_m
    return sorted_ids, torch.searchsorted(ends, firsts, right=True).to(torch.int32)


@triton.jit
def activate(acc_g, acc_u, alpha, limit, ACT: tl.constexpr):
    """An expert's activation of its gate and up rows (float32), by ``ACTIVATIONS``' code."""
    if ACT == 0:  # silu(gate) * up
        return acc_g * tl.sigmoid(acc_g) * acc_u
    g = tl.minimum(acc_g, limit)  # gpt_oss: (clamp(up, -l, l) + 1) * g * sigmoid(alpha g), g = clamp(gate, max=l)
    u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    return (u + 1) * (g * tl.sigmoid(g * alpha))


@triton.jit
def _up_kernel(x_ptr, w_ptr, b_ptr, act_ptr, sorted_ptr, block_expert_ptr, N, H, INTER,
               stride_x, stride_we, stride_wn, stride_be, stride_act, alpha, limit,
               TOP_K: tl.constexpr, E: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:  # past the last expert's blocks
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = rows < N  # padding slots hold N
    tok = (rows // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    kk = tl.arange(0, BLOCK_K)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + kk
        k_ok = k < H
        a = tl.load(x_ptr + tok[:, None] * stride_x + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_e + cols[None, :] * stride_wn + k[:, None], mask=wmask, other=0.0)  # [K, N]
        wu = tl.load(w_e + (INTER + cols)[None, :] * stride_wn + k[:, None], mask=wmask, other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
        acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
    if HAS_BIAS:
        b_e = b_ptr + e.to(tl.int64) * stride_be
        acc_g += tl.load(b_e + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_e + INTER + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = activate(acc_g, acc_u, alpha, limit, ACT)
    dst = act_ptr + rows.to(tl.int64)[:, None] * stride_act + cols[None, :]
    tl.store(dst, out.to(act_ptr.dtype.element_ty), mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, w_ptr, b_ptr, topw_ptr, y_ptr, sorted_ptr, block_expert_ptr, N, H, INTER,
                 stride_a, stride_we, stride_wn, stride_be, stride_y,
                 E: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    ok = rows < N
    r64 = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    kk = tl.arange(0, BLOCK_K)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k = k0 + kk
        k_ok = k < INTER
        a = tl.load(a_ptr + r64[:, None] * stride_a + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_e + cols[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(topw_ptr + rows, mask=ok, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + r64[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=ok[:, None] & col_ok[None, :])


def fused_moe(
    x: torch.Tensor,  # [T, H]
    weights: torch.Tensor,  # [T, k] routing weights (any float dtype)
    ids: torch.Tensor,  # [T, k] expert ids
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    b13: torch.Tensor | None = None,  # [E, 2I]
    b2: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    block_m: int | None = None,
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token: ``[T, H]`` in ``x``'s dtype.
    ``buffers``: the ``(act [N, I], y [N, H])`` the kernels write (tests pass oversized ones to see
    that padding writes nothing); new ones by default."""
    tokens, hidden, top_k, experts, inter = moe_shapes(x, ids, w13, w2, activation)
    n = tokens * top_k
    if n == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    bm = block_m or pick_block_m(tokens, top_k, experts)
    sorted_ids, block_expert = align(ids, experts, bm)
    if buffers is None:
        act = torch.empty((n, inter), dtype=x.dtype, device=x.device)
        y = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    else:
        act, y = buffers
    blocks = block_expert.shape[0]
    bn_up, bk_up = min(64, next_pow2(inter, 16)), min(64, next_pow2(hidden, 16))
    _up_kernel[(blocks, triton.cdiv(inter, bn_up))](
        x, w13, w13 if b13 is None else b13, act, sorted_ids, block_expert, n, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), 0 if b13 is None else b13.stride(0), act.stride(0),
        float(alpha), float(limit), TOP_K=top_k, E=experts, ACT=ACTIVATIONS[activation],
        HAS_BIAS=b13 is not None, BLOCK_M=bm, BLOCK_N=bn_up, BLOCK_K=bk_up, num_warps=4,
    )  # fmt: skip
    bn_dn, bk_dn = min(64, next_pow2(hidden, 16)), min(64, next_pow2(inter, 16))
    topw = weights.reshape(-1)
    _down_kernel[(blocks, triton.cdiv(hidden, bn_dn))](
        act, w2, w2 if b2 is None else b2, topw, y, sorted_ids, block_expert, n, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), 0 if b2 is None else b2.stride(0), y.stride(0),
        E=experts, HAS_BIAS=b2 is not None, BLOCK_M=bm, BLOCK_N=bn_dn, BLOCK_K=bk_dn, num_warps=4,
    )  # fmt: skip
    out = y[:n].view(tokens, top_k, hidden)
    return out[:, 0].clone() if top_k == 1 else out.sum(dim=1, dtype=torch.float32).to(x.dtype)
