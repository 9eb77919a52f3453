"""The state layers' kernel strategy (serving/models/state_kernels.py).

CPU: the fla path's plumbing (slots gathered into ``initial_state``, final states scattered back,
sequences cut at their snapshot offsets, decode batches without ``cu_seqlens``, Mamba2's
value-first state) through stand-ins with fla's signatures that compute the recurrence per
sequence, against the torch scan; a speculative verify row's scratch states against running
only that many tokens. CUDA (skipped without): the real fla-core kernels inside the
Gated DeltaNet and Mamba2 layers against the CPU torch reference, chunked prefill with snapshots,
decode and a continued extend, within a TF32 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from serving.models import state_kernels
from serving.models.gated_deltanet import GatedDeltaNet
from serving.models.mamba2 import Mamba2Mixer
from serving.models.state_scan import StatePlan
from serving.structs.forward_batch import ForwardBatch

PAGE = 16
SLOTS = 12


def _plan(lens: list[int], slots: list[int], snaps: list[int], offs: list[int], device: str = "cpu",
          width: int = 4) -> StatePlan:
    seqs = []
    for i, n in enumerate(lens):
        seqs.append((list(range(n)), 0, list(range(i * 20, i * 20 + (n + PAGE - 1) // PAGE))))
    batch = ForwardBatch.build(seqs, PAGE, device, state_slots=slots, snap_slots=snaps, snap_offsets=offs)
    return StatePlan.build(batch, width)


def _sequences(cu, n_in_batch, *xs):
    if cu is None:  # [B, 1, ...]: B sequences of one token
        return [tuple(x[i] for x in xs) for i in range(n_in_batch)]
    cu = cu.tolist()
    return [tuple(x[0, a:b] for x in xs) for a, b in zip(cu[:-1], cu[1:], strict=True)]


def fake_gdn(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
             cu_seqlens=None):
    """fla's gated delta rule signature, per sequence and token (float64)."""
    rep = v.shape[-2] // q.shape[-2]
    outs, finals = [], []
    for i, (qs, ks, vs, gs, bs) in enumerate(_sequences(cu_seqlens, q.shape[0], q, k, v, g, beta)):
        s = initial_state[i].double()
        o = []
        for t in range(qs.shape[0]):
            qt, kt = (x[t].double().repeat_interleave(rep, 0) for x in (qs, ks))
            s = s * gs[t].double().exp()[:, None, None]
            delta = (vs[t].double() - torch.einsum("hkv,hk->hv", s, kt)) * bs[t].double()[:, None]
            s = s + kt[:, :, None] * delta[:, None, :]
            o.append(torch.einsum("hkv,hk->hv", s, qt * scale))
        outs.append(torch.stack(o))
        finals.append(s)
    o = torch.cat(outs)[None] if cu_seqlens is not None else torch.stack(outs)
    return o.to(v.dtype), torch.stack(finals).float()


def fake_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
             cu_seqlens=None):
    """fla's simple GLA signature (value-first state [H, V, K]), per sequence and token (float64)."""
    assert state_v_first
    outs, finals = [], []
    for i, (qs, ks, vs, gs) in enumerate(_sequences(cu_seqlens, q.shape[0], q, k, v, g)):
        s = initial_state[i].double()  # [H, V, K]
        o = []
        for t in range(qs.shape[0]):
            s = s * gs[t].double().exp()[:, None, None] + vs[t].double()[:, :, None] * ks[t].double()[:, None, :]
            o.append(torch.einsum("hvk,hk->hv", s, qs[t].double()) * scale)
        outs.append(torch.stack(o))
        finals.append(s)
    o = torch.cat(outs)[None] if cu_seqlens is not None else torch.stack(outs)
    return o.to(v.dtype), torch.stack(finals).float()


BATCHES = [  # (lens, working slots, snapshot slots, snapshot offsets)
    ([9, 5, 1, 7], [0, 1, 2, 3], [4, -1, 5, 6], [3, -1, 0, 6]),  # cut inside, none, one token, at the end
    ([1, 1, 1], [0, 1, 2], [-1, 7, -1], [-1, 0, -1]),  # decode, one snapshot
    ([6, 2], [1, 3], [-1, -1], [-1, -1]),  # no snapshot: one pass over all rows
    # speculative verify rows (SNAP_EVERY: the state after each token but the last into scratch 4-6, 9-10)
    # beside a decode row and a prefill chunk with a snapshot: passes of one token each after the first
    ([4, 1, 9, 3], [0, 1, 2, 3], [4, -1, 7, 9], [-2, -1, 5, -2]),
]


@pytest.mark.parametrize("case", range(len(BATCHES)))
def test_fla_plumbing_matches_the_torch_scan(monkeypatch, case) -> None:
    monkeypatch.setitem(state_kernels._FLA, "ops", {"gdn_chunk": fake_gdn, "gdn_recurrent": fake_gdn,
                                                   "gla_chunk": fake_gla, "gla_recurrent": fake_gla})
    lens, slots, snaps, offs = BATCHES[case]
    plan = _plan(lens, slots, snaps, offs)
    t, gen = sum(lens), torch.Generator().manual_seed(case)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = torch.nn.functional.normalize(rnd(t, 2, 8), dim=-1)
    k = torch.nn.functional.normalize(rnd(t, 2, 8), dim=-1)
    v, g, beta = rnd(t, 4, 6), -rnd(t, 4).abs(), rnd(t, 4).sigmoid()
    base = rnd(SLOTS, 4, 8, 6)
    outs, states = {}, {}
    for backend in ("torch", "fla"):
        rec = base.clone()
        outs[backend] = state_kernels.gated_delta_rule(q, k, v, g, beta, 8**-0.5, rec, plan, backend).float()
        states[backend] = rec
    torch.testing.assert_close(outs["fla"], outs["torch"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states["fla"], states["torch"], rtol=1e-4, atol=1e-5)
    assert not torch.equal(states["torch"][slots[0]], base[slots[0]])
    x, dt, a = rnd(t, 4, 5), rnd(t, 4).abs() * 0.3, -rnd(4).abs()
    b, c = rnd(t, 2, 7), rnd(t, 2, 7)
    base = rnd(SLOTS, 4, 5, 7)
    for backend in ("torch", "fla"):
        rec = base.clone()
        outs[backend] = state_kernels.ssd(x, dt, a, b, c, rec, plan, backend).float()
        states[backend] = rec
    torch.testing.assert_close(outs["fla"], outs["torch"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states["fla"], states["torch"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("lens", "kernel"), [([1, 1], "recurrent"), ([64, 3], "recurrent"), ([65, 1], "chunk")])
def test_short_extends_take_the_recurrent_kernel(monkeypatch, lens, kernel) -> None:
    """Decode and extends of at most RECURRENT_MAX_TOKENS tokens a sequence (a cache hit's suffix) run
    fla's one-launch fused recurrent kernel, longer ones its chunked kernel: both layers' recurrences."""
    called: list[str] = []

    def spy(name, fake):
        return lambda *a, **kw: (called.append(name), fake(*a, **kw))[1]
    monkeypatch.setitem(state_kernels._FLA, "ops", {
        "gdn_chunk": spy("chunk", fake_gdn), "gdn_recurrent": spy("recurrent", fake_gdn),
        "gla_chunk": spy("chunk", fake_gla), "gla_recurrent": spy("recurrent", fake_gla)})
    plan = _plan(lens, [0, 1], [-1, -1], [-1, -1])
    t = sum(lens)
    q = k = torch.nn.functional.normalize(torch.randn(t, 2, 8), dim=-1)
    state_kernels.gated_delta_rule(q, k, torch.randn(t, 4, 6), -torch.rand(t, 4), torch.rand(t, 4), 0.3,
                                   torch.zeros(SLOTS, 4, 8, 6), plan, "fla")
    state_kernels.ssd(torch.randn(t, 4, 5), torch.rand(t, 4) * 0.3, -torch.rand(4), torch.randn(t, 2, 7),
                      torch.randn(t, 2, 7), torch.zeros(SLOTS, 4, 5, 7), plan, "fla")
    assert called == [kernel, kernel], called


def test_passes_cut_at_snapshots() -> None:
    plan = _plan(*BATCHES[0])
    first, second = plan.passes
    assert first.seqs is None and first.rows.tolist() == [0, 1, 2, 3, *range(9, 22)]
    assert first.cu_host == (0, 4, 9, 10, 17)
    assert first.snap_idx.tolist() == [0, 2, 3] and first.snap_slots.tolist() == [4, 5, 6]
    assert second.seqs.tolist() == [0] and second.rows.tolist() == [4, 5, 6, 7, 8] and second.cu_host == (0, 5)
    assert not second.snap_idx.numel()
    (only,) = _plan(*BATCHES[2]).passes
    assert only.rows is None and only.seqs is None and not only.one_token
    assert _plan(*BATCHES[1]).passes[0].one_token
    verify = _plan(*BATCHES[3]).passes  # verify rows of 4 and 3 tokens: a pass for each of their tokens
    assert [p.seqs.tolist() if p.seqs is not None else None for p in verify] == [None, [0, 2, 3], [0, 3], [0]]
    assert [p.one_token for p in verify] == [False, False, True, True]  # the prefill's second piece in pass 1
    assert [p.snap_slots.tolist() for p in verify] == [[4, 7, 9], [5, 10], [6], []]


def test_backend_choice(monkeypatch) -> None:
    assert state_kernels.backend_for(torch.zeros(1)) == "torch"
    monkeypatch.setenv("HICACHE_STATE_BACKEND", "triton")
    with pytest.raises(ValueError, match="expected auto, torch or fla"):
        state_kernels.backend_for(torch.zeros(1))


# -- a speculative verify row: the state after each of its tokens but the last goes to scratch ---------
def _run_layer(layer, x, plan, conv, rec):
    with torch.inference_mode():
        return layer(x, plan, conv, rec)


TOKENS = 5  # the last token and 4 drafts
SCRATCH = 6  # scratch slots 6 .. 9


@pytest.mark.parametrize("backend", ["torch", "fla"])
@pytest.mark.parametrize("which", [0, 1], ids=["gated_deltanet", "mamba2"])
def test_verify_scratch_holds_the_state_after_each_token(monkeypatch, backend, which) -> None:
    """Scratch ``j`` holds the state (conv and recurrent) after the verify row's token ``j``, the
    working slot the state after its last, as running only that many tokens leaves them; the fla
    plumbing (through the stand-ins) runs the drafts one decode-shaped launch each."""
    if backend == "fla":
        monkeypatch.setitem(state_kernels._FLA, "ops", {"gdn_chunk": fake_gdn, "gdn_recurrent": fake_gdn,
                                                       "gla_chunk": fake_gla, "gla_recurrent": fake_gla})
        monkeypatch.setattr(state_kernels, "backend_for", lambda x: "fla")
    layer = _layers(0)[which]
    conv_shape, rec_shape = (t.shape for t in layer.state_tensors(torch.float32))
    gen = torch.Generator().manual_seed(which)
    conv0, rec0 = torch.randn(SLOTS, *conv_shape, generator=gen), torch.randn(SLOTS, *rec_shape, generator=gen)
    x = torch.randn(TOKENS + 1 + 7, 64, generator=gen)
    # the verify row (working slot 0) beside a decode row (slot 1) and a prefill chunk with a snapshot (slot 2)
    conv, rec = conv0.clone(), rec0.clone()
    out = _run_layer(layer, x, _plan([TOKENS, 1, 7], [0, 1, 2], [SCRATCH, -1, 11], [-2, -1, 3]), conv, rec)
    for j in range(TOKENS):
        c, r = conv0.clone(), rec0.clone()
        ref = _run_layer(layer, x[: j + 1], _plan([j + 1], [0], [-1], [-1]), c, r)
        slot = SCRATCH + j if j < TOKENS - 1 else 0
        torch.testing.assert_close(conv[slot], c[0], rtol=1e-5, atol=1e-6)  # (other row counts: other rounding)
        torch.testing.assert_close(rec[slot], r[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out[: j + 1], ref, rtol=1e-5, atol=1e-6)
    c, r = conv0.clone(), rec0.clone()  # the other rows are as without the verify row
    ref = _run_layer(layer, x[TOKENS:], _plan([1, 7], [1, 2], [-1, 11], [-1, 3]), c, r)
    torch.testing.assert_close(out[TOKENS:], ref, rtol=1e-5, atol=1e-6)
    for slot in (1, 2, 11):
        torch.testing.assert_close(rec[slot], r[slot], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(conv[slot], c[slot], rtol=1e-5, atol=1e-6)
    untouched = [s for s in range(SLOTS) if s not in (0, 1, 2, 11, *range(SCRATCH, SCRATCH + TOKENS - 1))]
    assert torch.equal(rec[untouched], rec0[untouched]) and torch.equal(conv[untouched], conv0[untouched])


# -- CUDA: the real fla-core kernels in the layers against the CPU torch reference -----------------
def _layers(seed: int) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    gdn = GatedDeltaNet(64, num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32, conv_kernel=4, eps=1e-6)
    mamba = Mamba2Mixer(64, num_heads=4, head_dim=16, state_size=32, n_groups=2, conv_kernel=4, eps=1e-5)
    for m in (gdn, mamba):
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn_like(p) * 0.2)
            m.A_log.copy_(torch.rand_like(m.A_log) * 0.5 - 1.0)
    return [gdn, mamba]


GPU_STEPS = [  # one conversation of batches over the same slots: prefill with snapshots, decode, extend
    ([150, 37, 1, 90], [0, 1, 2, 3], [4, -1, 5, 6], [63, -1, 0, 89]),
    ([1, 1, 1, 1], [0, 1, 2, 3], [-1, 7, -1, -1], [-1, 0, -1, -1]),
    ([70, 3], [0, 2], [8, -1], [40, -1]),
    ([1, 5, 3, 1], [0, 1, 2, 3], [-1, 4, 9, -1], [-1, -2, -2, -1]),  # verify rows: scratch 4-7, 9-10
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["fla", "torch"])
def test_cuda_layers_match_the_cpu_reference(monkeypatch, backend) -> None:
    """fla (or the torch scan with the CUDA conv) on the GPU vs the CPU torch path, float32 weights:
    outputs, working states and snapshot states (conv and recurrent) within TF32 rounding."""
    monkeypatch.setenv("HICACHE_STATE_BACKEND", backend)
    errs: dict[str, float] = {}
    for li, layer in enumerate(_layers(0)):
        conv_shape, rec_shape = (t.shape for t in layer.state_tensors(torch.float32))
        gen = torch.Generator().manual_seed(li)
        conv0, rec0 = torch.randn(SLOTS, *conv_shape, generator=gen), torch.randn(SLOTS, *rec_shape, generator=gen)
        ref_layer, gpu_layer = layer, _layers(0)[li].cuda()
        states = {"cpu": (conv0.clone(), rec0.clone()), "cuda": (conv0.cuda(), rec0.cuda())}
        for s, (lens, slots, snaps, offs) in enumerate(GPU_STEPS):
            x = torch.randn(sum(lens), 64, generator=gen)
            with torch.inference_mode():
                ref = ref_layer(x, _plan(lens, slots, snaps, offs), *states["cpu"])
                got = gpu_layer(x.cuda(), _plan(lens, slots, snaps, offs, "cuda"), *states["cuda"])
            name = type(layer).__name__
            errs[f"{name} step {s} out"] = _rel(got, ref)
            used = sorted({*slots, *(x + j for x, o, n in zip(snaps, offs, lens, strict=True) if x >= 0
                                     for j in range(n - 1 if o == -2 else 1))})
            for j, part in enumerate(("conv", "recurrent")):
                errs[f"{name} step {s} {part}"] = _rel(states["cuda"][j][used], states["cpu"][j][used])
    print({k: f"{v:.2e}" for k, v in errs.items()})
    bad = {k: v for k, v in errs.items() if v > 5e-3}
    assert not bad, bad
