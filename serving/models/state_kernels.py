"""Which kernels run the state layers' recurrences: the torch token-by-token scan
(serving/models/state_scan.py; the CPU reference, any device) or fla-core's Triton kernels on CUDA
(``fla.ops.gated_delta_rule``, ``fla.ops.simple_gla``: chunked prefill, fused recurrent decode).

fla-core is optional: it is imported on the first CUDA forward pass that wants it, and without it
(or with ``HICACHE_STATE_BACKEND=torch``) CUDA runs the torch scan. ``HICACHE_STATE_BACKEND=fla``
makes a missing fla-core an error instead.

fla runs whole sequences from an initial state, so the pool's slots are gathered into its
``initial_state`` and its ``output_final_state`` scattered back; a sequence with a snapshot is cut
after its snapshot token (``StatePlan.segments``): pass 1 ends exactly there, its final state is the
snapshot, and pass 2 continues from it. Both layers' recurrences are written in fla's terms:

- Gated DeltaNet: ``S = exp(g) S + k (beta (v - S^T k))^T``, ``o = scale S^T q`` (GVA: value head
  ``h`` reads key head ``h // (Hv / Hk)``), state ``[Hv, Dk, Dv]``;
- Mamba2 (SSD) as simple GLA: ``S = exp(dt A) S + B (dt x)^T``, ``y = S^T C`` (keys B and queries C
  of the head's group, values ``dt x``, scale 1); our state ``[H, head_dim, state_size]`` is fla's
  value-first layout (``state_v_first``).

Precision: fla's kernels take the model's dtype (bf16 in serving) with float32 gates and float32
states, and use TF32 / bf16 tensor-core dots; the torch scan is float32 throughout.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from serving.models.state_scan import StatePlan, scan

_FLA: dict[str, object] = {}


def backend_for(x: torch.Tensor) -> str:
    """``"fla"`` or ``"torch"`` for a forward pass on ``x``'s device."""
    want = os.environ.get("HICACHE_STATE_BACKEND", "auto")
    if want not in ("auto", "torch", "fla"):
        raise ValueError(f"HICACHE_STATE_BACKEND={want!r}: expected auto, torch or fla")
    if want == "torch" or not x.is_cuda:
        return "torch"
    if _fla() is None:
        if want == "fla":
            raise RuntimeError(f"HICACHE_STATE_BACKEND=fla but fla-core does not import: {_FLA['error']}")
        return "torch"
    return "fla"


def _fla() -> dict | None:
    if "ops" not in _FLA and "error" not in _FLA:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
            from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
        except Exception as e:  # noqa: BLE001 (any import failure means: use torch)
            _FLA["error"] = f"{type(e).__name__}: {e}"
        else:
            _FLA["ops"] = {"gdn_chunk": chunk_gated_delta_rule, "gdn_recurrent": fused_recurrent_gated_delta_rule,
                           "gla_chunk": chunk_simple_gla, "gla_recurrent": fused_recurrent_simple_gla}
    return _FLA.get("ops")  # type: ignore[return-value]


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float, recurrent: torch.Tensor, plan: StatePlan, backend: str) -> torch.Tensor:
    """q, k ``[T, Hk, Dk]`` (L2-normalized), v ``[T, Hv, Dv]``, g (log decay) and beta ``[T, Hv]``
    float32 -> o ``[T, Hv, Dv]``; ``recurrent [slots, Hv, Dk, Dv]`` updated at the plan's slots."""
    if backend == "fla":
        ops = _fla()
        kern = ops["gdn_recurrent"] if plan.is_decode else ops["gdn_chunk"]
        dt = v.dtype

        def run(q_, k_, v_, g_, b_, h0, cu):
            return kern(q_, k_, v_, g=g_, beta=b_, scale=scale, initial_state=h0, output_final_state=True,
                        cu_seqlens=cu)
        return run_segments(run, [q.to(dt), k.to(dt), v, g.float(), beta.to(dt)], recurrent, plan)
    rep = v.shape[1] // q.shape[1]
    qf = q.float().repeat_interleave(rep, dim=1) * scale
    kf = k.float().repeat_interleave(rep, dim=1)
    vf, decay, beta = v.float(), g.float().exp(), beta.float()

    def step(s: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = s * decay[rows][..., None, None]  # [A, Hv, Dk, Dv]
        kr = kf[rows]
        mem = torch.einsum("ahkv,ahk->ahv", s, kr)
        delta = (vf[rows] - mem) * beta[rows][..., None]
        s = s + kr[..., :, None] * delta[..., None, :]
        return s, torch.einsum("ahkv,ahk->ahv", s, qf[rows])

    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    scan(recurrent, plan, o, step)
    return o


def ssd(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
        recurrent: torch.Tensor, plan: StatePlan, backend: str, io_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Mamba2's scan without the skip term: x ``[T, H, P]``, dt ``[T, H]`` float32 (after softplus
    and clamp), a ``[H]`` (= -exp(A_log)), b / c ``[T, G, N]`` -> y ``[T, H, P]``;
    ``recurrent [slots, H, P, N]`` updated at the plan's slots. ``io_dtype``: fla's input dtype
    (the model's; default x's)."""
    rep = x.shape[1] // b.shape[1]
    if backend == "fla":
        ops = _fla()
        kern = ops["gla_recurrent"] if plan.is_decode else ops["gla_chunk"]
        dtype = io_dtype or x.dtype

        def run(q_, k_, v_, g_, h0, cu):
            return kern(q_, k_, v_, g=g_, scale=1.0, initial_state=h0, output_final_state=True,
                        state_v_first=True, cu_seqlens=cu)
        v = (dt[..., None] * x.float()).to(dtype)
        q = c.to(dtype).repeat_interleave(rep, dim=1)
        k = b.to(dtype).repeat_interleave(rep, dim=1)
        return run_segments(run, [q, k, v, dt * a.float()], recurrent, plan)
    bf = b.float().repeat_interleave(rep, dim=1)  # [T, H, N]
    cf = c.float().repeat_interleave(rep, dim=1)
    decay = torch.exp(dt * a.float())
    dtx = dt[..., None] * x.float()  # [T, H, P]

    def step(s: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = s * decay[rows][..., None, None] + dtx[rows][..., :, None] * bf[rows][..., None, :]
        return s, torch.einsum("ahpn,ahn->ahp", s, cf[rows])

    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    scan(recurrent, plan, y, step)
    return y


# run(*token-major inputs [1, T', ...], initial_state [N, ...], cu_seqlens or None) -> (out, final states)
RunFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def run_segments(run: RunFn, inputs: list[torch.Tensor], recurrent: torch.Tensor, plan: StatePlan) -> torch.Tensor:
    """Run a whole-sequence kernel over the batch (``inputs``: ``[T, ...]`` each), cut at the
    snapshot points (``plan.segments``): the working slots end at each sequence's last state, the
    snapshot slots take the state after their offset's token. Returns the outputs ``[T, ...]``."""
    h0 = recurrent[plan.slots].float()
    if plan.is_decode:  # B sequences of one token: no cu_seqlens; a snapshot is the final state
        o, hn = run(*(t.unsqueeze(1).contiguous() for t in inputs), h0, None)
        if plan.snap_seqs.numel():
            recurrent[plan.snap_slots] = hn[plan.snap_seqs].to(recurrent.dtype)
        recurrent[plan.slots] = hn.to(recurrent.dtype)
        return o[:, 0]
    seg = plan.segments
    part = inputs if seg.rows1 is None else [t[seg.rows1] for t in inputs]
    o1, hn = run(*(t.unsqueeze(0).contiguous() for t in part), h0, seg.cu1)
    if seg.rows1 is None:
        out = o1[0]
    else:
        out = o1.new_empty((inputs[0].shape[0], *o1.shape[2:]))
        out[seg.rows1] = o1[0]
    hn = hn.float()
    if plan.snap_seqs.numel():
        recurrent[plan.snap_slots] = hn[plan.snap_seqs].to(recurrent.dtype)
    if seg.seqs2.numel():
        part = [t[seg.rows2] for t in inputs]
        o2, h2 = run(*(t.unsqueeze(0).contiguous() for t in part), hn[seg.seqs2].contiguous(), seg.cu2)
        out[seg.rows2] = o2[0]
        hn[seg.seqs2] = h2.float()
    recurrent[plan.slots] = hn.to(recurrent.dtype)
    return out
