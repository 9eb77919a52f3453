"""Batch metadata for one forward pass, passed explicitly to the model and kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class LayerWaits:
    """GPU events of layered L2 -> L1 loads that a forward pass reads from: before layer ``i``
    touches the KV pool, the current stream waits (on the GPU; the host never blocks) for
    every load's layer-``i`` event. A decode-graph replay waits for all of them first
    (:meth:`before_all`); an extend-graph replay hands them to its :class:`GraphLayerWaits`."""

    __slots__ = ("per_layer",)

    def __init__(self, loads: list[list]) -> None:
        self.per_layer = list(zip(*loads, strict=True))  # [layers][loads]

    def before_layer(self, i: int) -> None:
        stream = torch.cuda.current_stream()
        for ev in self.per_layer[i]:
            stream.wait_event(ev)

    def before_all(self) -> None:
        self.before_layer(len(self.per_layer) - 1)  # each load's layers land in order


class GraphLayerWaits:
    """Per-layer waits inside captured CUDA graphs: one static external event per layer
    (``torch.cuda.Event(external=True)``). Captured, :meth:`before_layer` becomes an event-wait
    node on layer ``i``'s event; before a replay, :meth:`arm` re-records each event on a relay
    stream behind that layer's events of the loads the batch reads (:class:`LayerWaits`), so
    inside the replay layer ``i`` waits only for its own KV.

    Contract: every event is recorded once at construction (PyTorch creates a CUDA event at its
    first record, and a wait on one never recorded is not captured), so with no load in flight
    the events are complete. A replay that arms nothing waits on the last arming's records,
    which an earlier replay on the same stream already waited for: complete by then. Arming
    happens on the host before the replay's launch; a wait node waits for the record that was
    the event's latest when the graph was launched (as ``cudaStreamWaitEvent`` does when it is
    called), so a later arming cannot move an earlier replay's waits (checked on the GPU by
    tests/engine/test_gpu.py). One user: the scheduler thread."""

    @classmethod
    def create(cls, num_layers: int, device: torch.device) -> GraphLayerWaits | None:
        """None on a CPU, or with a PyTorch without external events (before 2.9): a replay then
        waits for every load before it starts (``LayerWaits.before_all``)."""
        if device.type != "cuda":
            return None
        try:
            return cls(num_layers, device)
        except TypeError:
            return None

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.events = [torch.cuda.Event(external=True) for _ in range(num_layers)]
        self.relay = torch.cuda.Stream(device)
        stream = torch.cuda.current_stream(device)
        for ev in self.events:
            ev.record(stream)
        self.armed = 0  # replays armed (for tests and stats)

    def before_layer(self, i: int) -> None:
        torch.cuda.current_stream().wait_event(self.events[i])

    def arm(self, waits: LayerWaits) -> None:
        """Re-record layer ``i``'s event behind every load's layer-``i`` event (a group of
        layers shares its load events: each is waited once)."""
        if len(waits.per_layer) != len(self.events):
            raise ValueError(f"{len(waits.per_layer)} layers of load events for {len(self.events)} layers")
        prev: tuple = ()
        for ev, loads in zip(self.events, waits.per_layer, strict=True):
            if len(loads) != len(prev) or any(a is not b for a, b in zip(loads, prev, strict=True)):
                for load in loads:
                    self.relay.wait_event(load)
                prev = loads
            ev.record(self.relay)
        self.armed += 1


@dataclass
class ForwardBatch:
    """A ragged batch: sequence ``i`` adds ``extend_lens[i]`` new tokens on top of
    ``prefix_lens[i]`` tokens whose KV is already in the paged pool.

    Decode is the special case ``extend_lens == 1`` for every sequence. All new
    tokens of all sequences are concatenated along one token axis ``T``.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each new token
    prefix_lens: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32 = prefix_lens + extend_lens
    extend_start: torch.Tensor  # [B] int32, offset of sequence i's first new token in T
    page_table: torch.Tensor  # [B, max_pages] int32 page ids, padded with 0
    out_cache_loc: torch.Tensor  # [T] int64 flat slot (page_id * page_size + offset) of each new token
    page_size: int
    # Python copies for loops on the host (avoid device syncs)
    prefix_lens_list: list[int]
    extend_lens_list: list[int]
    # decode only: fixed number of KV splits (CUDA graphs fix the grid); None picks per batch
    decode_splits: int | None = None
    # extend graphs: the captured bucket (tokens, sequences) the extend kernel's launch is sized for,
    # not this batch's lengths (serving.kernels.triton_extend_split); None: sized for this batch
    extend_bucket: tuple[int, int] | None = None
    # prompt logprobs (serving.model.logprobs): rows of T whose logits the model also returns, after the B last ones
    logit_rows: torch.Tensor | None = None
    # L2 -> L1 loads still landing in pages this batch reads (GPU only); see LayerWaits
    layer_waits: LayerWaits | GraphLayerWaits | None = None
    # the host buffers ``build`` made (int64 part, int32 part, T, B, width): what tensor parallelism
    # sends the other ranks (serving.parallel), without reading anything back from the device
    host: tuple | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens_list)

    @property
    def max_seq_len(self) -> int:
        return max(p + e for p, e in zip(self.prefix_lens_list, self.extend_lens_list, strict=True))

    @staticmethod
    def build(
        seqs: list[tuple[list[int], int, list[int]]],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Build from ``(new_token_ids, prefix_len, page_ids)`` per sequence.

        ``page_ids`` must cover positions ``0 .. prefix_len + len(new_token_ids) - 1``.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        locs: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        starts: list[int] = []
        max_pages = max(len(p) for _, _, p in seqs)
        width = max(max_pages, 1)
        table = [0] * (len(seqs) * width)  # [B, width] row-major, padded with 0
        for i, (ids, prefix, pages) in enumerate(seqs):
            n = len(ids)
            if prefix + n > len(pages) * page_size:
                raise ValueError(f"sequence {i}: {prefix + n} tokens do not fit {len(pages)} pages")
            starts.append(len(input_ids))
            input_ids.extend(ids)
            pos = range(prefix, prefix + n)
            positions.extend(pos)
            locs.extend(pages[p // page_size] * page_size + p % page_size for p in pos)
            prefix_lens.append(prefix)
            extend_lens.append(n)
            table[i * width: i * width + len(pages)] = pages
        dev = torch.device(device)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
        t, b = len(input_ids), len(seqs)
        # Two host buffers (int64 and int32), pinned on CUDA and copied without blocking: a
        # pageable copy would wait for the forward pass already running on the GPU.
        i64 = torch.tensor(input_ids + positions + locs, dtype=torch.int64)
        i32 = torch.tensor(prefix_lens + extend_lens + seq_lens + starts + table, dtype=torch.int32)
        return ForwardBatch.from_host(i64, i32, t, b, width, page_size, prefix_lens, extend_lens, dev)

    @staticmethod
    def from_host(i64: torch.Tensor, i32: torch.Tensor, t: int, b: int, width: int, page_size: int,
                  prefix_lens: list[int], extend_lens: list[int], device: torch.device | str) -> ForwardBatch:
        """The batch of ``build``'s two host buffers (also how another TP rank rebuilds it)."""
        dev = torch.device(device)
        host = (i64, i32, t, b, width)
        if dev.type == "cuda":
            i64 = i64.pin_memory().to(dev, non_blocking=True)
            i32 = i32.pin_memory().to(dev, non_blocking=True)
        elif dev.type != "cpu":
            i64, i32 = i64.to(dev), i32.to(dev)
        return ForwardBatch(
            input_ids=i64[:t],
            positions=i64[t: 2 * t],
            prefix_lens=i32[:b],
            extend_lens=i32[b: 2 * b],
            seq_lens=i32[2 * b: 3 * b],
            extend_start=i32[3 * b: 4 * b],
            page_table=i32[4 * b:].view(b, width),
            out_cache_loc=i64[2 * t:],
            page_size=page_size,
            prefix_lens_list=prefix_lens,
            extend_lens_list=extend_lens,
            host=host,
        )
