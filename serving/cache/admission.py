"""What admitting a waiting request answers: ``ReqCache.try_admit``'s result, read by the scheduler
(serving/scheduler/prefill.py); and the key the ``lpm`` admission order ranks waiting requests by."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hicache.hiradix import HiRadixTree


def lpm_key(tree: HiRadixTree, tokens: list[int]) -> int:
    """Cached prefix tokens of ``tokens``, those on L1 counting twice (SGLang's lpm ranks by the L1
    prefix: a request that runs on its L1 pages goes before one that must load them, whose load would
    evict them first). Read-only: no hit counts, no backups."""
    node, matched = tree.lookup(tokens)
    device = 0
    for nd in reversed(node.path_to_root()):
        if nd.device_pages is None:
            break
        device += len(nd.key)
    return min(device, matched) + matched


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
