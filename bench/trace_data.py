"""A Mooncake-format request trace: loading, slicing, deterministic prompt tokens, and the
LRU-of-blocks bound the replays are measured against (bench/trace_replay.py).

Format (../shared/traces/README.md): one JSON object a line, ``timestamp`` (ms), ``input_length``,
``output_length``, ``hash_ids`` (one id per 512-token block; equal ids = the same prefix block).
There is no text: the tokens of a block are a pure function of its id (splitmix64 of
``id * block_tokens + position``), so shared blocks get identical tokens, and the last block is
cut to ``input_length``. ``block_tokens`` below 512 shrinks every block (and the cut of the last
one) by the same factor: the same reuse structure in fewer tokens (for small test servers).
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_BLOCK = 512  # tokens per hash id in the trace
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


@dataclass(frozen=True)
class TraceRequest:
    index: int  # line number in the trace
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path = DEFAULT_TRACE) -> list[TraceRequest]:
    """Every request of the trace, in order. Raises ValueError naming the line of a malformed
    one (hash ids that do not cover ``input_length`` in 512-token blocks, say)."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                r = TraceRequest(i, float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                 tuple(int(h) for h in d["hash_ids"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i + 1}: not a trace request ({e})") from None
            if r.input_length <= 0 or len(r.hash_ids) != -(-r.input_length // TRACE_BLOCK):
                raise ValueError(f"{path}:{i + 1}: {len(r.hash_ids)} hash ids for {r.input_length} tokens")
            out.append(r)
    return out


def select(reqs: Sequence[TraceRequest], start: int = 0, count: int | None = None,
           busiest: int = 0) -> list[TraceRequest]:
    """A slice in trace order: with ``busiest`` > 0 only the requests of the ``busiest``
    conversation chains with the most requests (a chain: requests whose first block is the
    same), then ``count`` requests from ``start``."""
    reqs = list(reqs)
    if busiest > 0:
        top = {h for h, _ in Counter(r.hash_ids[0] for r in reqs).most_common(busiest)}
        reqs = [r for r in reqs if r.hash_ids[0] in top]
    return reqs[start : None if count is None else start + count]


@dataclass(frozen=True)
class BlockTokens:
    """Makes the prompt tokens of trace requests (see the module docstring)."""

    block_tokens: int = TRACE_BLOCK
    vocab_size: int = 32000
    low: int = 10  # ids below this are never used (special tokens of small vocabularies)

    def __post_init__(self) -> None:
        if not 1 <= self.block_tokens <= TRACE_BLOCK:
            raise ValueError(f"block_tokens must be in 1..{TRACE_BLOCK}, got {self.block_tokens}")
        if self.vocab_size <= self.low + 1:
            raise ValueError(f"vocab_size {self.vocab_size} too small")

    def length(self, r: TraceRequest) -> int:
        """The prompt's length in tokens (``input_length`` at ``block_tokens`` per block)."""
        last = r.input_length - TRACE_BLOCK * (len(r.hash_ids) - 1)
        return self.block_tokens * (len(r.hash_ids) - 1) + -(-last * self.block_tokens // TRACE_BLOCK)

    def block_lengths(self, r: TraceRequest) -> list[int]:
        n = self.length(r)
        return [min(self.block_tokens, n - i * self.block_tokens) for i in range(len(r.hash_ids))]

    def tokens(self, r: TraceRequest) -> list[int]:
        b = self.block_tokens
        ids = np.asarray(r.hash_ids, dtype=np.uint64)
        x = (ids[:, None] * np.uint64(b) + np.arange(b, dtype=np.uint64)[None, :]).reshape(-1)
        x = x + np.uint64(0x9E3779B97F4A7C15)  # splitmix64 (wrapping uint64 arithmetic)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
        tok = x % np.uint64(self.vocab_size - self.low) + np.uint64(self.low)
        return tok[: self.length(r)].astype(np.int64).tolist()


def lru_block_bound(reqs: Sequence[TraceRequest], capacity_tokens: int,
                    blocks: BlockTokens = BlockTokens()) -> dict[str, float]:
    """Prompt tokens an LRU of whole blocks with ``capacity_tokens`` of room would serve, prefix
    hits only: a request hits its leading blocks that are cached (each counts its own length,
    the cut last block included); then all its blocks become most recently used (in prompt
    order) and the least recently used blocks leave until the cached blocks' tokens fit. A block
    occupies its longest length seen. Returns ``{"hit_tokens", "prompt_tokens", "hit_rate"}``."""
    lru: OrderedDict[int, int] = OrderedDict()
    used = hit = total = 0
    for r in reqs:
        lens = blocks.block_lengths(r)
        total += sum(lens)
        for h, n in zip(r.hash_ids, lens, strict=True):
            if h not in lru:
                break
            hit += n
        for h, n in zip(r.hash_ids, lens, strict=True):
            old = lru.pop(h, 0)
            lru[h] = max(old, n)
            used += max(old, n) - old
        while used > capacity_tokens and lru:
            used -= lru.popitem(last=False)[1]
    return {"hit_tokens": hit, "prompt_tokens": total, "hit_rate": hit / max(1, total)}


def output_tokens(index: int, n: int, vocab_size: int, low: int = 10) -> list[int]:
    """Deterministic stand-in output tokens of request ``index`` (never shared with a prompt)."""
    if n <= 0:
        return []
    return (np.random.default_rng(1_000_003 + index).integers(low, vocab_size, n)).tolist()
