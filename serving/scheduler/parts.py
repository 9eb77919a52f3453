"""The scheduler's optional parts, as the scheduler sees them: typed protocols, so that
``serving.scheduler`` names what it calls without importing the packages that implement them
(structured output: serving/grammar/runner.py's ``GrammarRunner``; speculative decoding:
serving/speculative/worker.py's ``SpeculativeWorker``; a prefill or decode server's PD role:
serving/disagg/role_base.py's ``PDRole``). Each is None on a scheduler that runs without it.
The implementations satisfy these structurally (tests/engine/test_scheduler_parts.py checks that they do).
Every method runs on the scheduler thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from serving.structs.request import Req


class MaskFill(Protocol):
    def apply(self, logits: torch.Tensor) -> None:
        """Join the mask fill started before the forward pass and mask ``logits`` in place."""


@runtime_checkable
class GrammarPart(Protocol):
    """Structured output: masks, the matcher's advance, jump-forward, compiles waited for."""

    def poll(self, st: Any) -> bool: ...

    def release(self, st: Any) -> None: ...

    def active(self, reqs: Sequence[Req]) -> bool: ...

    def begin_masks(self, reqs: Sequence[Req]) -> MaskFill | None: ...

    def accept(self, r: Req, tok: int) -> dict[str, Any] | None: ...

    def jump_forward(self, r: Req, append: Callable[[Req, int], None]) -> None: ...


@runtime_checkable
class SpeculativePart(Protocol):
    """Speculative decoding: drafts proposed before a step, verified after it."""

    def speculating(self, reqs: list[Req]) -> bool: ...

    def propose(self, decode: list[Req], prefill: bool) -> None: ...

    def observe(self, seconds: float) -> None: ...

    def drafts(self, r: Req) -> list[int]: ...

    def verify_rows(self, batch: list[tuple[Req, int]]) -> list[int]: ...

    def accept(self, items: list[tuple[Req, int, int]], logits: torch.Tensor,
               append: Callable[[Req, int], None]) -> list[Req]: ...

    def forget(self, r: Req) -> None: ...


@runtime_checkable
class PDRolePart(Protocol):
    """A prefill or decode server's role: requests it holds, sends or receives outside the batch."""

    def on_add(self, req: Req) -> bool: ...

    def on_finish(self, req: Req) -> bool: ...

    def step(self) -> list[tuple[Req, int]]:
        """Move what is ready on; the requests whose prompt KV arrived, each with its first token."""

    def abort(self, rid: str) -> Req | None: ...

    @property
    def busy(self) -> bool: ...

    def held_pages(self) -> int: ...
