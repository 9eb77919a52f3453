"""The state layers' plan on static buffers for extend graphs (serving/models/state_graph.py) against the
eager plan (``StatePlan.build``): the same conv and recurrence outputs, working states and snapshots, for
batches with and without snapshots (at a sequence's first, middle and last token), padding sequences and
padding tokens, and the same buffers refilled batch after batch (as replays do). CPU, float32: the torch
scan (eager) against fla's whole-sequence contract in torch (the static plan's two passes)."""

from __future__ import annotations

import pytest
import torch

from serving.models.state_graph import ExtendStatePlan
from serving.models.state_kernels import gated_delta_rule, ssd
from serving.models.state_scan import StatePlan, causal_conv
from serving.structs.forward_batch import SNAP_EVERY, ForwardBatch

WIDTH, SLOTS, PAD = 4, 12, 12  # the pool's scratch row is slot 12
HK, HV, DK, DV = 2, 4, 8, 6

BATCHES = [  # per sequence: (new tokens, prefix, snapshot offset or -1)
    [(5, 0, -1)],
    [(7, 3, 4), (1, 9, -1), (3, 0, 2)],
    [(2, 0, 0), (6, 4, 5), (4, 1, -1), (1, 0, 0)],
    [(12, 0, 3)],
    [(3, 2, -1), (3, 2, 1)],
]


def _batch(seqs: list[tuple[int, int, int]], g: torch.Generator) -> ForwardBatch:
    ids = [[int(x) for x in torch.randint(0, 50, (n,), generator=g)] for n, _, _ in seqs]
    built = [(t, p, list(range(8))) for t, (_, p, _) in zip(ids, seqs, strict=True)]
    slots = [2 * i for i in range(len(seqs))]
    snaps = [2 * i + 1 if k >= 0 else -1 for i, (_, _, k) in enumerate(seqs)]
    return ForwardBatch.build(built, 4, "cpu", state_slots=slots, snap_slots=snaps,
                              snap_offsets=[k for _, _, k in seqs])


def _inputs(t: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)
    return {"x": r(t, 10), "q": torch.nn.functional.normalize(r(t, HK, DK), dim=-1),
            "k": torch.nn.functional.normalize(r(t, HK, DK), dim=-1), "v": r(t, HV, DV),
            "g": -torch.rand(t, HV, generator=g), "beta": torch.rand(t, HV, generator=g),
            "dt": torch.rand(t, HV, generator=g), "b": r(t, 1, DK), "c": r(t, 1, DK), "xs": r(t, HV, DV)}


def _run(plan: StatePlan, inp: dict[str, torch.Tensor], states: dict[str, torch.Tensor], t: int) -> list[torch.Tensor]:
    weight = torch.linspace(-1, 1, 10 * WIDTH).view(10, WIDTH)
    conv = causal_conv(inp["x"][:t] if plan.graph is None else _pad(inp["x"], plan), states["conv"], weight,
                       None, plan)
    pad = (lambda name: inp[name][:t]) if plan.graph is None else (lambda name: _pad(inp[name], plan))
    o = gated_delta_rule(pad("q"), pad("k"), pad("v"), pad("g"), pad("beta"), DK**-0.5, states["gdn"], plan, "torch")
    y = ssd(pad("xs"), pad("dt"), -torch.ones(HV), pad("b"), pad("c"), states["ssd"], plan, "torch")
    return [conv[:t], o[:t], y[:t]]


def _pad(x: torch.Tensor, plan: StatePlan) -> torch.Tensor:
    """The bucket's token rows: the batch's, then padding (garbage the outputs' cut drops)."""
    t = plan.tok_rows.shape[0]
    return torch.cat([x, torch.full((t - x.shape[0], *x.shape[1:]), 7.5)]) if x.shape[0] < t else x


def _states(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"conv": torch.randn(SLOTS + 1, 10, WIDTH - 1, generator=g),
            "gdn": torch.randn(SLOTS + 1, HV, DK, DV, generator=g),
            "ssd": torch.randn(SLOTS + 1, HV, DV, DK, generator=g)}


@pytest.mark.parametrize("tokens,seqs", [(32, 4), (16, 4), (32, 16)])
def test_static_plan_matches_the_eager_plan(tokens: int, seqs: int) -> None:
    g = torch.Generator().manual_seed(0)
    static = ExtendStatePlan(tokens, seqs, WIDTH, PAD, torch.device("cpu"))
    ran = 0
    for spec in BATCHES:
        if sum(n for n, _, _ in spec) > tokens or len(spec) > seqs:
            continue
        batch = _batch(spec, g)
        t = batch.num_tokens
        inp = _inputs(t, g)
        start = _states(g)
        eager_states = {k: v.clone() for k, v in start.items()}
        graph_states = {k: v.clone() for k, v in start.items()}
        eager = _run(StatePlan.build(batch, WIDTH), inp, eager_states, t)
        static.fill_batch(batch)
        got = _run(static.plan, inp, graph_states, t)
        for a, b in zip(got, eager, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for name in start:  # every slot but the scratch row: working states and snapshots
            torch.testing.assert_close(graph_states[name][:SLOTS], eager_states[name][:SLOTS], atol=1e-5, rtol=1e-5)
            assert not torch.equal(graph_states[name][:SLOTS], start[name][:SLOTS])
        ran += 1
    assert ran >= 3


def test_static_plan_refuses_what_it_cannot_hold() -> None:
    g = torch.Generator().manual_seed(1)
    static = ExtendStatePlan(16, 2, WIDTH, PAD, torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit"):
        static.fill([5, 5, 5], [0, 2, 4], [-1] * 3, [-1] * 3)
    with pytest.raises(ValueError, match="do not fit"):
        static.fill([10, 7], [0, 2], [-1] * 2, [-1] * 2)
    verify = ForwardBatch.build([([1, 2, 3], 0, [0])], 4, "cpu", state_slots=[0], snap_slots=[4],
                                snap_offsets=[SNAP_EVERY])
    assert not ExtendStatePlan.fits(verify)
    assert ExtendStatePlan.fits(_batch([(3, 0, 1)], g))
