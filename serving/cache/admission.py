"""What admitting a waiting request answers: ``ReqCache.try_admit``'s result, read by the scheduler
(serving/scheduler/prefill.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Answer(enum.Enum):
    """What the scheduler does with a waiting request it tried to admit."""

    READY = "ready"  # admitted: prefix locked, its first chunk's pages reserved; it computes in this pass
    LOADING = "loading"  # admitted as READY, but a load of pages it reads is still landing (an L2 -> L1 copy on
    #                      the CPU): it runs in a later pass, once ReqCache.poll_load says so
    WAIT = "wait"  # not admitted, nothing taken: it stays queued (its L3 prefetch is still worth waiting for)
    NO_ROOM = "no_room"  # not admitted, its prefix given back: L1 has no room for its chunk (or it waits for
    #                      L1 room to load its L2 hit): admission stops for this pass


@dataclass(frozen=True)
class Admission:
    answer: Answer
    tokens: int = 0  # prompt tokens of its first chunk, its pages reserved (READY / LOADING)
    first: bool = False  # its first admission (not a retracted request's return): its cache hits count now
