"""Load or recompute? A cost model for KV found in L3.

Loading ``n`` pages from the store costs ``fixed + n * page_bytes / bandwidth``; recomputing
them costs ``n * page_size / prefill_rate``. Both sides are measured while serving, with
exponential forgetting: the store's fixed cost and bandwidth are a least-squares line through
the (bytes, seconds) of recent fetches, the engine's prefill rate the median over the last
steps that prefilled enough tokens to be timed. The lookup that found the pages is not counted:
it has happened by the time the decision is made. The prefix must be in place before its suffix
is computed, so the time to first token is linear in how much of the prefix is loaded: the
minimum is at one end -- load all of it or none -- which is what :meth:`decide` picks.

Under load the recompute does not start at once: the prefill tokens queued ahead of the request
(``backlog_tokens``: admitted prompts still prefilling and earlier waiting ones, the scheduler's
count) run first, while a load runs beside them. So a request loads when ``load <= backlog +
recompute`` (both at the measured prefill rate); the estimate it reports, and the fetch's cut
(serving/cache/prefetch_policy.py ``LoadBudget``), use that sum.

Exploration: before the first measurement of a side the model loads (it must learn the
store's speed somehow), and every ``explore_every``-th refusal loads anyway, so an estimate
made on a cold disk or a busy store is refreshed once the store is fast again.

Concurrency contract: scheduler thread only (the prefetcher reports finished reads there).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from serving.structs.request import Req


class _Ema:
    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


class _Median:
    """Median of the last ``window`` samples (a first step's one-time start-up cost, or a step
    slowed by something else, does not skew it)."""

    def __init__(self, window: int) -> None:
        self._xs: deque[float] = deque(maxlen=window)

    def add(self, x: float) -> None:
        self._xs.append(x)

    @property
    def value(self) -> float | None:
        return statistics.median(self._xs) if self._xs else None


class _LineFit:
    """``seconds ~ fixed + bytes / bandwidth`` by least squares over exponentially weighted
    moments; with too little spread in sizes, a line through the origin."""

    def __init__(self, alpha: float) -> None:
        self._m = [_Ema(alpha) for _ in range(4)]  # x, y, xx, xy

    def add(self, x: float, y: float) -> None:
        for m, v in zip(self._m, (x, y, x * x, x * y), strict=True):
            m.add(v)

    def params(self) -> tuple[float, float] | None:
        """(fixed seconds, bytes per second) or None before any sample."""
        x, y, xx, xy = (m.value for m in self._m)
        if x is None or x <= 0:
            return None
        var = xx - x * x
        if var > 1e-6 * x * x:
            slope = (xy - x * y) / var
            fixed = y - slope * x
            if slope > 0 and fixed >= 0:
                return fixed, 1.0 / slope
        return 0.0, x / y if y > 0 else float("inf")


@dataclass(frozen=True)
class Decision:
    load: bool
    load_s: float | None  # estimated time to load (None: not known yet)
    recompute_s: float | None  # estimated time to recompute
    reason: str


EXPLORE = "recompute is faster; loading to re-measure"


class LoadPolicy:
    """Decides whether L3 pages are loaded; registry below (``hicache_storage_load_policy``)."""

    def decide(self, pages: int, explore: bool = True, backlog_tokens: int = 0) -> Decision:
        """Load ``pages`` pages or recompute them? ``explore=False``: never an exploratory load
        (a second look at a request whose first decision was made before its lookup);
        ``backlog_tokens``: prefill tokens queued ahead of the request (module docstring)."""
        raise NotImplementedError

    def observe_prefill(self, tokens: int, seconds: float) -> None:  # noqa: B027 - optional
        pass

    def observe_read(self, nbytes: int, seconds: float) -> None:  # noqa: B027 - optional
        pass

    def stats(self) -> dict[str, float]:
        return {}


class AlwaysLoad(LoadPolicy):
    def decide(self, pages: int, explore: bool = True, backlog_tokens: int = 0) -> Decision:
        return Decision(True, None, None, "always_load")


class CostModel(LoadPolicy):
    """Load or recompute, from the store's measured fixed cost and bandwidth and the measured
    prefill rate (see the module docstring).

    Concurrency contract: the scheduler thread only: the prefetcher's fetches
    (``serving.cache.l3_fetch.Fetches``) report finished reads there (:meth:`observe_read`),
    ``PrefillTimer`` reports prefills (:meth:`observe_prefill`), the prefetcher asks
    :meth:`decide`. No lock, no thread, nothing here waits.
    """

    MIN_PREFILL_TOKENS = 64  # steps with fewer prefill tokens are dominated by decode: not timed

    def __init__(self, page_bytes: int, page_size: int, alpha: float = 0.25, explore_every: int = 16) -> None:
        self.page_bytes = page_bytes
        self.page_size = page_size
        self.explore_every = explore_every
        self._reads = _LineFit(alpha)  # (bytes, seconds) of fetches
        self._prefill = _Median(16)  # tokens / s
        self._refused = 0
        self.refusals = 0
        self.tokens_recomputed = 0  # tokens found in L3 and recomputed because that was faster

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= self.MIN_PREFILL_TOKENS and seconds > 0:
            self._prefill.add(tokens / seconds)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._reads.add(float(nbytes), seconds)

    def _prefill_s(self, tokens: int) -> float | None:
        rate = self._prefill.value
        return None if rate is None else tokens / rate

    def estimate(self, pages: int, backlog_tokens: int = 0) -> tuple[float | None, float | None]:
        """(load seconds, seconds until recomputed: the backlog's prefill, then the pages')."""
        fit = self._reads.params()
        load = None if fit is None else fit[0] + pages * self.page_bytes / fit[1]
        return load, self._prefill_s(pages * self.page_size + max(0, backlog_tokens))

    def decide(self, pages: int, explore: bool = True, backlog_tokens: int = 0) -> Decision:
        load_s, recompute_s = self.estimate(pages, backlog_tokens)
        if load_s is None or recompute_s is None:
            return Decision(True, load_s, recompute_s, "not measured yet: load")
        if load_s <= recompute_s:
            own_s = self._prefill_s(pages * self.page_size)  # the pages' own recompute, without the backlog
            return Decision(True, load_s, recompute_s, "load is faster" if own_s is not None and load_s <= own_s
                            else "load is faster than recomputing behind the queued prefills")
        if explore:
            self._refused += 1
            if self._refused % self.explore_every == 0:
                return Decision(True, load_s, recompute_s, EXPLORE)
        self.refusals += 1
        self.tokens_recomputed += pages * self.page_size
        return Decision(False, load_s, recompute_s, "recompute is faster")

    def stats(self) -> dict[str, float]:
        fixed, bw = self._reads.params() or (0.0, 0.0)
        return {
            "cost_l3_read_gbps": bw / 1e9,
            "cost_l3_fixed_ms": 1e3 * fixed,
            "cost_prefill_tok_s": self._prefill.value or 0.0,
            "cost_l3_refusals": self.refusals,
            "cost_tokens_recomputed_although_cached": self.tokens_recomputed,
        }


LOAD_POLICIES = {"cost_model": CostModel, "always_load": AlwaysLoad}


def prefill_backlog(req: Req, running: Sequence[Req], waiting: Sequence[Req], page_size: int) -> int:
    """Prefill tokens queued ahead of ``req``: what the admitted requests still prefill, and the
    prompts of the waiting requests that came before it less their prefixes cached when they were
    looked up (their whole prompts before that)."""
    n = sum(r.seq_len - r.kv.kv_len for r in running if r.prefilling)
    for r in waiting:
        if r is not req and r.created <= req.created:
            op = r.kv.prefetch
            n += max(0, r.seq_len - (op.start_page * page_size if op is not None else 0))
    return n


def make_load_policy(name: str, page_bytes: int, page_size: int) -> LoadPolicy:
    try:
        cls = LOAD_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown L3 load policy {name!r}; choose from {sorted(LOAD_POLICIES)}") from None
    return cls(page_bytes, page_size) if cls is CostModel else cls()
