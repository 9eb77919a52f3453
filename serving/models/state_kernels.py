"""Which kernels run the state layers' recurrences: the torch token-by-token scan
(serving/models/state_scan.py; the CPU reference, any device) or fla-core's Triton kernels on CUDA
(``fla.ops.gated_delta_rule``, ``fla.ops.simple_gla``: chunked prefill, fused recurrent decode).

fla-core is optional: it is imported on the first CUDA forward pass that wants it, and without it
(or with ``HICACHE_STATE_BACKEND=torch``) CUDA runs the torch scan. ``HICACHE_STATE_BACKEND=fla``
makes a missing fla-core an error instead.

Decode and passes of at most ``RECURRENT_MAX_TOKENS`` tokens a sequence (a cache hit's suffix) run
fla's fused recurrent kernels (one launch a pass); longer passes its chunked ones (a dozen launches,
each fla call ~0.8 ms of host time on the H200). fla runs whole sequences from an initial state, so
the pool's slots are gathered into its
``initial_state`` and its ``output_final_state`` scattered back; a sequence with a snapshot is cut
after its snapshot token (``StatePlan.passes``): one pass ends exactly there, its final state is the
snapshot, and the next continues from it. A speculative verify row (a snapshot after every token
but the last) thus runs one token a pass through the fused recurrent kernel, the launch decode
makes: exact by construction, a launch per draft. Both layers' recurrences are written in fla's terms:

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

from serving.models.state_scan import StatePlan, StepFn, scan

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
    if backend == "fla" or plan.graph is not None:  # whole sequences from an initial state (an extend graph's too)
        dt = v.dtype
        if backend == "fla":
            ops = _fla()

            def run(q_, k_, v_, g_, b_, h0, cu, recurrent):
                kern = ops["gdn_recurrent"] if recurrent else ops["gdn_chunk"]
                return kern(q_, k_, v_, g=g_, beta=b_, scale=scale, initial_state=h0, output_final_state=True,
                            cu_seqlens=cu)
        else:
            def run(q_, k_, v_, g_, b_, h0, cu, recurrent):
                return _pieces(_gdn_step(q_[0], k_[0], v_[0], g_[0], b_[0], scale), v_.shape[1:], h0, cu)
        return run_segments(run, [q.to(dt), k.to(dt), v, g.float(), beta.to(dt)], recurrent, plan)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    scan(recurrent, plan, o, _gdn_step(q, k, v, g, beta, scale))
    return o


def _gdn_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float) -> StepFn:
    """The gated delta rule's step over token rows (float32; see the module docstring)."""
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
    return step


def _gla_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> StepFn:
    """Simple GLA's step in the value-first layout: ``S = exp(g) S + v k^T``, ``o = S q`` (float32)."""
    qf, kf, vf, decay = q.float(), k.float(), v.float(), g.float().exp()

    def step(s: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = s * decay[rows][..., None, None] + vf[rows][..., :, None] * kf[rows][..., None, :]
        return s, torch.einsum("ahpn,ahn->ahp", s, qf[rows])
    return step


def _pieces(step: StepFn, shape: torch.Size, h0: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's whole-sequence contract in torch (the reference on CPU, where an extend graph's static plan runs
    eagerly): the pieces ``cu`` cuts token rows into, each from its initial state in ``h0``; returns
    (outputs ``[1, *shape]``, final states). Reads ``cu`` on the host: never inside a CUDA graph."""
    bounds = cu.tolist()
    starts, lens = bounds[:-1], [z - a for a, z in zip(bounds, bounds[1:], strict=False)]
    state = h0.float().clone()
    out = torch.zeros(shape, dtype=torch.float32, device=h0.device)
    for t in range(max(lens, default=0)):
        seqs = [i for i, n in enumerate(lens) if n > t]
        idx = torch.tensor(seqs, device=h0.device)
        rows = torch.tensor([starts[i] + t for i in seqs], device=h0.device)
        state[idx], out[rows] = step(state[idx], rows)
    return out.unsqueeze(0), state


def ssd(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
        recurrent: torch.Tensor, plan: StatePlan, backend: str, io_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Mamba2's scan without the skip term: x ``[T, H, P]``, dt ``[T, H]`` float32 (after softplus
    and clamp), a ``[H]`` (= -exp(A_log)), b / c ``[T, G, N]`` -> y ``[T, H, P]``;
    ``recurrent [slots, H, P, N]`` updated at the plan's slots. ``io_dtype``: fla's input dtype
    (the model's; default x's)."""
    rep = x.shape[1] // b.shape[1]
    dtype = (io_dtype or x.dtype) if backend == "fla" else torch.float32
    q = c.to(dtype).repeat_interleave(rep, dim=1)  # fla's simple GLA: queries C, keys B, values dt x
    k = b.to(dtype).repeat_interleave(rep, dim=1)
    v = (dt[..., None] * x.float()).to(dtype)
    g = dt * a.float()
    if backend == "fla" or plan.graph is not None:  # whole sequences from an initial state (an extend graph's too)
        if backend == "fla":
            ops = _fla()

            def run(q_, k_, v_, g_, h0, cu, recurrent):
                kern = ops["gla_recurrent"] if recurrent else ops["gla_chunk"]
                return kern(q_, k_, v_, g=g_, scale=1.0, initial_state=h0, output_final_state=True,
                            state_v_first=True, cu_seqlens=cu)
        else:
            def run(q_, k_, v_, g_, h0, cu, recurrent):
                return _pieces(_gla_step(q_[0], k_[0], v_[0], g_[0]), v_.shape[1:], h0, cu)
        return run_segments(run, [q, k, v, g], recurrent, plan)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    scan(recurrent, plan, y, _gla_step(q, k, v, g))
    return y


RECURRENT_MAX_TOKENS = 64  # passes whose pieces have at most this many tokens run fla's fused recurrent kernel

# run(*token-major inputs [N, T', ...], initial_state [N, ...], cu_seqlens, recurrent) -> (out, final states):
# with cu_seqlens, one row of ragged sequences ([1, T', ...]); None, N sequences of one token each
# ([N, 1, ...], as in decode); ``recurrent``: fla's fused recurrent kernel, else its chunked one
RunFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def run_segments(run: RunFn, inputs: list[torch.Tensor], recurrent: torch.Tensor, plan: StatePlan) -> torch.Tensor:
    """Run a whole-sequence kernel over the batch (``inputs``: ``[T, ...]`` each), cut at the
    snapshot points (``plan.passes``): each pass starts its sequences from the state the one before
    left them, the snapshot slots take the state after their offset's token, the working slots end
    at each sequence's last state. A pass of one token per sequence (decode; a verify row's drafts)
    is the decode kernel's launch. Returns the outputs ``[T, ...]``."""
    if plan.graph is not None:  # an extend graph's static passes (serving/models/state_graph.py)
        return plan.graph.run(run, inputs, recurrent, plan.slots)
    state = recurrent[plan.slots].float()
    out: torch.Tensor | None = None
    for ps in plan.passes:
        part = inputs if ps.rows is None else [t[ps.rows] for t in inputs]
        h0 = (state if ps.seqs is None else state[ps.seqs]).contiguous()
        if ps.one_token:
            o, hn = run(*(t.unsqueeze(1).contiguous() for t in part), h0, None, True)
            o = o[:, 0]
        else:
            o, hn = run(*(t.unsqueeze(0).contiguous() for t in part), h0, ps.cu,
                        ps.longest <= RECURRENT_MAX_TOKENS)
            o = o[0]
        if ps.rows is None:
            out = o
        else:
            if out is None:
                out = o.new_empty((inputs[0].shape[0], *o.shape[1:]))
            out[ps.rows] = o
        hn = hn.float()
        if ps.snap_idx.numel():
            recurrent[ps.snap_slots] = hn[ps.snap_idx].to(recurrent.dtype)
        if ps.seqs is None:
            state = hn
        else:
            state[ps.seqs] = hn
    recurrent[plan.slots] = state.to(recurrent.dtype)
    assert out is not None
    return out
