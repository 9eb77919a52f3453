"""When a waiting request stops waiting for its L3 prefetch (SGLang's policy names; serving/cache/l3_prefetch.py),
and the bound every policy keeps when the load policy can estimate recompute (:class:`LoadBudget`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.cache.prefetch_op import PrefetchOp


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


CUT_GRACE = 0.1  # share of the pages' recompute time a cut may come after the break-even
MIN_CUT_S = 0.05  # never cut a fetch younger than this (a reader thread's start, a busy host's hiccup)


@dataclass(frozen=True)
class LoadBudget:
    """A started fetch that has fallen behind recompute is cut: the request takes what has landed and
    recomputes the rest (a long prefix whose writes are still in flight, a slow or busy disk). At ``t``
    seconds after the fetch started, with ``landed`` of its ``pages`` in L2, the load has run at
    ``landed / t`` pages a second; cutting now costs about ``t + (pages - landed) * c`` (``c``: one page's
    recompute time, the load policy's estimate), waiting ``t + (pages - landed) * t / landed``: the cut
    pays once ``t > landed * c``. Reads land a group of pages at a time, several groups at once, so the
    pages of every group a reader has started count as landed (``reading``: a stalled group is seen
    once it should have been done) and the cut comes once ``t >= (reading + CUT_GRACE * pages) * c`` and
    the fetch has taken longer than the load policy expected (``floor_s``: its estimate, at least
    :data:`MIN_CUT_S`). So a request waits at most about ``(1 + CUT_GRACE)`` times the recompute of its
    pages for the load, whatever the prefetch policy (its own rule may stop the wait earlier), and then
    recomputes what had not landed. Built only where the load policy has both estimates: a load before
    the store was ever measured runs to its end (it is how the store gets measured)."""

    started: float  # time.monotonic() when the fetch started (or was followed)
    page_recompute_s: float
    pages: int
    floor_s: float

    @classmethod
    def of(cls, load_s: float | None, recompute_s: float | None, pages: int, fetch_pages: int,
           now: float) -> LoadBudget | None:
        """For ``fetch_pages`` of the ``pages`` a decision estimated at ``load_s`` / ``recompute_s``;
        None when either estimate is missing."""
        if not load_s or not recompute_s or pages <= 0:
            return None
        return cls(now, recompute_s / pages, fetch_pages, max(load_s, MIN_CUT_S))

    def exceeded(self, reading: int, now: float) -> bool:
        """``reading``: the pages landed or being read (see the class docstring)."""
        t = now - self.started
        return t >= self.floor_s and t >= (reading + CUT_GRACE * self.pages) * self.page_recompute_s


PREFETCH_POLICIES: dict[str, type[PrefetchPolicy]] = {
    "best_effort": BestEffort, "wait_complete": WaitComplete, "timeout": Timeout}
