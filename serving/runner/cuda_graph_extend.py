"""CUDA graphs for small extend (prefill) batches: a cache hit's suffix, a short prompt, a
prefill chunk mixed with decodes.

An extend of a few dozen tokens is bound by kernel launches like a decode step (a 16-token
prompt of the 8B shape took 3.7 decode steps eagerly), so extend batches of up to
``cuda_graph_max_extend_tokens`` new tokens (default 256; 1024 for a model with sliding-window or state
layers: :func:`extend_token_budget`) replay graphs captured per bucket (tokens, sequences): tokens 16, 32,
64, ... (powers of two) up to the budget and the budget itself; per token size, sequences 1, 16 and
``min(tokens, cuda_graph_max_bs)`` (14 graphs with the defaults 256 / 64, 20 with 1024). A batch
takes the smallest bucket that holds it.

Graph-safety, as for decode (``serving.runner.cuda_graph``): every input lives in a static buffer
overwritten in place by ``run``; intermediates come from the graphs' private pool; the
rotary table is whole before capture; nothing syncs with the host. The attention launch is
sized by the bucket, never by prefix or extend lengths (``ForwardBatch.extend_bucket``,
``serving.kernels.triton_extend_split``). Padding tokens store no KV (slot -1) and are cut;
padding sequences have no new tokens (no tile of the attention kernel) and their logit rows
are cut.

L2 -> L1 loads in flight: the graphs wait per layer on static external events
(``GraphLayerWaits``), armed before each replay from the batch's ``LayerWaits``.

Batches that ask for the logits of more rows than each sequence's last (``ForwardBatch.logit_rows``:
speculative verification, prompt logprobs) replay a second set of graphs, captured only for
``row_buckets`` (the engine asks for them when speculative decoding is on: buckets up to 128
tokens and 16 sequences): their static batch asks for every token row of the bucket
(``logit_rows`` a static buffer, the batch's rows first, the rest pointing at row 0), so the
output is ``[sequences + tokens, vocab]`` and the batch's rows are cut from it.

A hybrid SWA L1: the static batches have a static window view (``ForwardBatch.win``), filled per
replay as in the decode graphs (``serving.runner.cuda_graph.WindowBuffers``).

State layers (Gated DeltaNet, Mamba2): each bucket has a state plan on static buffers
(``serving.models.state_graph.ExtendStatePlan``: the conv's rows and two passes of the whole-sequence
kernel, padding on the state pool's scratch row), filled per replay from the batch's host lists. A batch
with a speculative verify row (a snapshot after every token) runs eagerly.

``capture=False`` keeps the buckets, static buffers and padding but runs the forward pass
eagerly on them: the same code path for tests on a CPU (Triton's interpreter).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from serving.models.layer_spec import LayerStack
from serving.models.state_graph import ExtendStatePlan
from serving.runner.cuda_graph import WindowBuffers
from serving.structs.forward_batch import ForwardBatch, GraphLayerWaits

log = logging.getLogger(__name__)

MIN_TOKENS = 16  # the smallest token bucket
SEQ_SIZES = (1, 16)  # sequence buckets below the cap min(tokens, max sequences)
MAX_TOKENS = 256  # the default budget of new tokens a captured extend takes
# ... for a hybrid model (sliding-window or state layers): its eager extends are launch-bound far longer
# (state layers: fla's chunked kernels cost ~0.8 ms of host time a call, two calls a layer at a snapshot
# cut; Gemma-3: six norms a layer and the window views), and a turn of returning requests (a few hundred new
# tokens each, beside the decodes of those already answering) replays graphs instead. Measured on the H200
# (Qwen3.5, 16 conversations, concurrent returning turns): 0.81 s a turn against 2.04 s with 256
# (bench/results/mt-probe-qwen3_5-ext1024-l3-h200-2026-12-05.json); Gemma-3 12B's probe of the same load ran
# ~49 eager forwards a turn with 256 (mt-probe-gemma3-swa0.2-l3-h200-2026-12-05.json).
HYBRID_MAX_TOKENS = 1024


def extend_token_budget(configured: int | None, stack: LayerStack) -> int:
    """The new-token budget of the captured extend buckets: the configured one, else the default for
    the model's layers (:data:`MAX_TOKENS`; :data:`HYBRID_MAX_TOKENS` for one with sliding-window or state
    layers)."""
    if configured is not None:
        return configured
    hybrid = bool(stack.state_layers) or any(w is not None for w in stack.windows)
    return HYBRID_MAX_TOKENS if hybrid else MAX_TOKENS


def extend_buckets(max_tokens: int, max_seqs: int) -> list[tuple[int, int]]:
    """Captured (tokens, sequences) pairs for a budget of ``max_tokens`` new tokens and at most
    ``max_seqs`` sequences. Token sizes are powers of two from 16 and the budget, so that every
    token count rounds up to the same power of two as its bucket does (the split-KV kernel's
    split count depends on that only)."""
    if max_tokens <= 0 or max_seqs <= 0:
        raise ValueError("max_tokens and max_seqs must be positive")
    tokens, t = [], MIN_TOKENS
    while t < max_tokens:
        tokens.append(t)
        t *= 2
    tokens.append(max_tokens)
    out = []
    for t in tokens:
        cap = min(t, max_seqs)
        out += [(t, s) for s in SEQ_SIZES if s < cap] + [(t, cap)]
    return out


class ExtendGraphRunner:
    """Static buffers and captured graphs of extend batches (see the module doc). One user:
    the scheduler thread (or a TP rank's command loop)."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        buckets: list[tuple[int, int]],
        context_len: int,
        page_size: int,
        num_layers: int,
        device: torch.device,
        capture: bool = True,
        keep_alive: object = None,
        row_buckets: list[tuple[int, int]] = (),
        windows: bool = False,
        make_state_plan: Callable[[int, int], ExtendStatePlan] | None = None,
    ) -> None:
        """``windows``: the pool has a window pool (a hybrid SWA L1): batches come with a window view.
        ``make_state_plan`` (tokens, sequences) -> a bucket's state plan, for a model with state layers."""
        self.forward = forward
        self.buckets = sorted(set(buckets))  # by tokens, then sequences: the first fit is the smallest
        self.max_tokens = max(t for t, _ in self.buckets)
        self.max_seqs = max(s for _, s in self.buckets)
        self.context_len = context_len
        self.page_size = page_size
        self.max_pages = -(-context_len // page_size)
        self.device = device
        self.capture = capture
        self.keep_alive = keep_alive  # tensors the graphs read that nobody else may free
        t, n = self.max_tokens, self.max_seqs
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(t, **i64)
        self.positions = torch.zeros(t, **i64)
        self.out_cache_loc = torch.full((t,), -1, **i64)
        self.prefix_lens = torch.zeros(n, **i32)
        self.extend_lens = torch.zeros(n, **i32)  # zeros: no tile, so warm-up and capture touch no KV
        self.seq_lens = torch.zeros(n, **i32)
        self.extend_start = torch.zeros(n, **i32)
        self.page_table = torch.zeros((n, self.max_pages), **i32)
        self.logit_rows = torch.zeros(t, **i64)  # the extra rows of a row graph's batch (then row 0)
        self.win = WindowBuffers(n, t, self.max_pages, device) if windows else None
        self.waits = GraphLayerWaits.create(num_layers, device)
        self.row_buckets = sorted(set(row_buckets) & set(self.buckets))
        self.state_plans = {b: make_state_plan(*b) for b in self.buckets} if make_state_plan else None
        # key (tokens, sequences, rows?): the row graphs ask for every token row besides the last ones
        self.batches = {(*b, False): self._static_batch(*b) for b in self.buckets}
        self.batches.update({(*b, True): self._static_batch(*b, rows=True) for b in self.row_buckets})
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, bool], torch.Tensor] = {}
        self.replays = 0
        self.capture_s = 0.0
        if capture:
            self._capture_all()

    def _static_batch(self, t: int, s: int, rows: bool = False) -> ForwardBatch:
        fb = ForwardBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t], prefix_lens=self.prefix_lens[:s],
            extend_lens=self.extend_lens[:s], seq_lens=self.seq_lens[:s], extend_start=self.extend_start[:s],
            page_table=self.page_table[:s], out_cache_loc=self.out_cache_loc[:t], page_size=self.page_size,
            # the host lists describe the bucket, not a batch: not a decode batch, and max_seq_len =
            # context_len (the rotary table is built whole before capture)
            prefix_lens_list=[self.context_len] * s, extend_lens_list=[0] * s,
            extend_bucket=(t, s), layer_waits=self.waits, logit_rows=self.logit_rows[:t] if rows else None,
        )
        if self.state_plans is not None:
            fb.state_plan = self.state_plans[(t, s)].plan
            fb.state_slots = fb.state_plan.slots
        return fb if self.win is None else self.win.attach(fb, s, t)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        for b in sorted(self.batches, reverse=True):  # largest first: the smaller graphs reuse its pool memory
            fb = self.batches[b]
            side.wait_stream(main)
            with torch.cuda.stream(side):  # warm-up: compiles the Triton kernels, fills caches
                self.forward(fb)
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.forward(fb)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        log.info("captured %d extend CUDA graphs (tokens x sequences: %s; with every row: %s) in %.2f s",
                 len(self.graphs), ", ".join(f"{t}x{s}" for t, s in self.buckets),
                 ", ".join(f"{t}x{s}" for t, s in self.row_buckets) or "none", self.capture_s)

    def bucket_for(self, tokens: int, seqs: int, rows: bool = False) -> tuple[int, int] | None:
        for t, s in self.row_buckets if rows else self.buckets:
            if t >= tokens and s >= seqs:
                return t, s
        return None

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            not batch.is_decode  # decode batches have their own graphs
            and batch.extend_bucket is None
            and batch.page_size == self.page_size
            and batch.page_table.shape[1] <= self.max_pages
            and batch.max_seq_len <= self.context_len
            and (batch.win is not None) == (self.win is not None)
            and (batch.state_slots is not None) == (self.state_plans is not None)
            and (self.state_plans is None or ExtendStatePlan.fits(batch))
            and self.bucket_for(batch.num_tokens, batch.batch_size, batch.logit_rows is not None) is not None
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[B, vocab]`` of an extend batch (``can_run`` must hold). The tensor is the
        graph's output buffer: read it before the next replay."""
        t, b = batch.num_tokens, batch.batch_size
        rows = batch.logit_rows
        bucket = self.bucket_for(t, b, rows is not None)
        assert bucket is not None
        tb, sb = bucket
        w = batch.page_table.shape[1]
        for static, src in ((self.input_ids, batch.input_ids), (self.positions, batch.positions),
                            (self.out_cache_loc, batch.out_cache_loc)):
            static[:t].copy_(src, non_blocking=True)
        for static, src in ((self.prefix_lens, batch.prefix_lens), (self.extend_lens, batch.extend_lens),
                            (self.seq_lens, batch.seq_lens), (self.extend_start, batch.extend_start)):
            static[:b].copy_(src, non_blocking=True)
        self.page_table[:b, :w].copy_(batch.page_table, non_blocking=True)
        if self.win is not None:
            self.win.fill(batch.win, tb)
        if self.state_plans is not None:
            self.state_plans[bucket].fill_batch(batch)
        if tb > t:  # padding tokens: no KV stored, cut from the output
            self.input_ids[t:tb].zero_()
            self.positions[t:tb].zero_()
            self.out_cache_loc[t:tb].fill_(-1)
        if rows is not None:  # the batch's extra rows, then row 0 (computed, cut)
            self.logit_rows[: rows.shape[0]].copy_(rows, non_blocking=True)
            self.logit_rows[rows.shape[0]: tb].zero_()
        if sb > b:  # padding sequences: no new tokens (no attention tile); their last row is cut
            self.prefix_lens[b:sb].zero_()
            self.extend_lens[b:sb].zero_()
            self.seq_lens[b:sb].zero_()
            self.extend_start[b:sb].fill_(tb)
        if batch.layer_waits is not None:
            if self.waits is not None:
                self.waits.arm(batch.layer_waits)  # layer i of the replay waits for layer i of the loads
            else:
                batch.layer_waits.before_all()
        self.replays += 1
        key = (*bucket, rows is not None)
        if self.capture:
            self.graphs[key].replay()
            out = self.outputs[key]
        else:
            out = self.forward(self.batches[key])
        if rows is None:
            return out[:b]
        return torch.cat([out[:b], out[sb: sb + rows.shape[0]]])
