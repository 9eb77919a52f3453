"""What a request carries for the scheduler's optional parts, as the code outside each part reads it:
typed protocols, so that :class:`serving.structs.request.Req` names its fields' types without
importing the packages that own them (this package sits at the bottom of the import graph).

- :class:`GrammarSlot`: structured output; its owner is serving/grammar/runner.py's ``GrammarState``;
- :class:`LogprobSlot`: logprobs asked for; serving/runner/logprobs.py's ``LogprobState``;
- :class:`SpecSlot`: speculative decoding; serving/speculative/policy.py's ``SpecState``;
- :class:`PrefetchSlot` (``Req.kv.prefetch``): an L3 prefetch in flight; serving/cache/prefetch_op.py's
  ``PrefetchOp``.

Each owner reads and writes the rest of its state; everyone else goes through what is named here
(tests/engine/test_scheduler_parts.py checks that the owners offer it).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class GrammarSlot(Protocol):
    """A request's grammar, as the scheduler and the engine see it: whether its compile is done, and
    the request's finish reason when the compile failed."""

    failure: dict[str, Any] | None

    @property
    def ready(self) -> bool: ...


class LogprobSlot(Protocol):
    """A request's logprobs: the cache match they allow, the output rows recorded, what is new to send;
    ``input`` / ``output``: every ``[logprob, token_id]`` pair so far (the offline frontends read them)."""

    input: list[Any]
    output: list[Any]

    def cache_limit(self, page_size: int) -> int | None: ...

    def record_output(self, logits: torch.Tensor, token: int, output_ids: list[int]) -> None: ...

    def take_new(self, output_ids: list[int]) -> dict[str, Any] | None: ...


class PrefetchSlot(Protocol):
    """A waiting request's L3 -> L2 prefetch: the L2 pages of its cached prefix it holds pinned until it
    ends, and whether it only keeps that prefix (no lookup, no fetch: ``watching``)."""

    pinned: list[int]
    start_page: int  # its prompt's pages cached on L1 / L2 when it was looked up

    @property
    def watching(self) -> bool: ...


class SpecSlot(Protocol):
    """A request's speculation, as reported: SGLang's ``spec_*`` ``meta_info`` fields."""

    def meta(self) -> dict[str, Any]: ...
