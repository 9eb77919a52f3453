"""When a waiting request stops waiting for its L3 prefetch (SGLang's policy names; serving/cache/l3_prefetch.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.cache.l3_prefetch import PrefetchOp


class PrefetchPolicy:
    """When a waiting request stops waiting for its prefetch (SGLang's names)."""

    def ready(self, op: PrefetchOp, now: float) -> bool:
        raise NotImplementedError


class BestEffort(PrefetchPolicy):
    """Never wait: take whatever has arrived when the request is scheduled."""

    def ready(self, op: PrefetchOp, now: float) -> bool:
        return True


class WaitComplete(PrefetchPolicy):
    def ready(self, op: PrefetchOp, now: float) -> bool:
        return op.fetched


class Timeout(PrefetchPolicy):
    """Wait until done or ``base + per_1k_tokens * tokens / 1000`` seconds have passed."""

    def ready(self, op: PrefetchOp, now: float) -> bool:
        return op.fetched or now >= op.deadline


PREFETCH_POLICIES: dict[str, type[PrefetchPolicy]] = {
    "best_effort": BestEffort, "wait_complete": WaitComplete, "timeout": Timeout}
