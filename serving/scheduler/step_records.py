"""What one scheduler step carries from its plan to its forward pass to its commit
(serving/scheduler/scheduler.py: ``_plan`` -> ``_forward`` -> ``_commit``). Plain records, made and
read on the scheduler thread within one step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serving.scheduler.parts import MaskFill, SpeculativePart
from serving.structs.request import Req


@dataclass
class StepPlan:
    """A step's rows: ``(request, new tokens)`` (a decode row with drafts has 1 + drafts), the
    speculative part in use this step (None: none), the requests to report (finished outside the
    step, resolved from an overlapped one) before this step's own."""

    batch: list[tuple[Req, int]]
    spec: SpeculativePart | None
    updated: list[Req]


@dataclass
class StepForward:
    """A forward pass's results: the last row of each request (``logits``; ``all_logits`` with the
    extra rows), the grammar masks being filled, where the drafts' verify rows start."""

    logits: torch.Tensor
    all_logits: torch.Tensor
    masks: MaskFill | None
    verify_at: int
