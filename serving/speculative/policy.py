"""How many drafts a request gets each step, and when it stops drafting (auto-off).

A verification pass over ``1 + k`` tokens costs about ``1 + c0 + c1 k`` decode steps (``c0``
once, ``c1`` per draft: measured by serving.speculative.cost; small on a GPU, larger on a CPU
and with the batch size). If each draft is accepted with probability ``a`` (given the ones
before it were), one pass yields ``E(k) = 1 + a + .. + a^k`` tokens on average. The budget is
the ``k`` in ``0 .. max_drafts`` that maximizes ``E(k) / (1 + c0 + c1 k)`` (``k = 0``: 1), with
``a`` estimated from the request's last 8 verifications (accepted drafts over accepted + first
rejections, with a uniform prior). ``k = 0`` (no draft pays) turns the request's drafting off
for ``backoff`` decode steps (32 first), which doubles each time (up to ``max_backoff``) and
halves back after verifications that pay; a request without recent verifications (new, or back
from an auto-off) gets ``PROBE_DRAFTS`` drafts whatever their estimated cost (the worker asks a
match of 4 tokens at least for those), so the estimates stay current. A request whose drafts
keep missing decodes almost exactly like plain decoding, and one whose text turns repetitive
later gets drafts again.

``miss_limit`` (set where a step without drafts is cheaper than a speculative one, e.g. a CUDA
step that can be overlapped): that many consecutive steps without any match turn drafting off
the same way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from serving.speculative.history import RequestHistory

PROBE_DRAFTS = 2  # drafts of a request without recent verifications, whatever their estimated cost


@dataclass
class SpecState:
    """One request's speculation (``Req.spec``). Counters as SGLang's ``meta_info`` reports them."""

    history: RequestHistory
    drafts: list[int] = field(default_factory=list)  # this step's drafts (empty: a plain decode row)
    mask_row: int = -1  # structured output: the first row of this step's masks (serving.speculative.worker)
    verify_ct: int = 0  # decode steps that verified drafts
    drafted: int = 0  # drafts proposed
    accepted: int = 0  # drafts accepted
    recent: deque = field(default_factory=lambda: deque(maxlen=8))  # (accepted, rejected one?) per verify
    off_left: int = 0  # decode steps left without drafts (auto-off)
    backoff: int = 0  # the next auto-off's length
    auto_off: int = 0  # times turned off
    misses: int = 0  # consecutive steps whose suffix matched nothing

    def meta(self) -> dict[str, Any]:
        """``meta_info`` fields (SGLang's names): verify steps, mean tokens per verify step (drafts
        accepted + the bonus token), the share of drafts accepted, the counts."""
        ct = self.verify_ct
        return {
            "spec_verify_ct": ct,
            "spec_accept_length": (self.accepted + ct) / ct if ct else 1.0,
            "spec_accept_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "spec_draft_token_num": self.drafted,
            "spec_accept_token_num": self.accepted,
            "spec_auto_off": self.auto_off,
        }


class DraftPolicy:
    def __init__(self, max_drafts: int, min_backoff: int = 32, max_backoff: int = 1024,
                 miss_limit: int | None = None) -> None:
        self.max_drafts = max_drafts
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self.miss_limit = miss_limit

    def acceptance(self, st: SpecState) -> float:
        acc = sum(a for a, _ in st.recent)
        rej = sum(r for _, r in st.recent)
        return (acc + 1) / (acc + rej + 2)

    def best_k(self, a: float, cost: tuple[float, float]) -> int:
        c0, c1 = cost
        best, best_v, e, p = 0, 1.0, 1.0, 1.0
        for k in range(1, self.max_drafts + 1):
            p *= a
            e += p
            v = e / (1 + c0 + c1 * k)
            if v > best_v * 1.02:  # a gain under 2%: not worth the risk
                best, best_v = k, v
        return best

    def budget(self, st: SpecState, cost: tuple[float, float]) -> int:
        """Drafts this request may get this step (0: a plain decode row); ``cost``: ``(c0, c1)`` now."""
        if st.off_left > 0:
            st.off_left -= 1
            return 0
        k = self.best_k(self.acceptance(st), cost)
        if k == 0 and not st.recent:  # new, or back from an auto-off: a probe (its result and cost measured)
            k = min(self.max_drafts, PROBE_DRAFTS)
        if k == 0:
            self._turn_off(st)
        return k

    def _turn_off(self, st: SpecState) -> None:
        st.backoff = min(self.max_backoff, max(self.min_backoff, 2 * st.backoff))
        st.off_left = st.backoff
        st.auto_off += 1
        st.recent.clear()
        st.misses = 0

    def on_miss(self, st: SpecState) -> None:
        """The request's suffix matched nothing this step."""
        st.misses += 1
        if self.miss_limit is not None and st.misses >= self.miss_limit:
            self._turn_off(st)

    def on_verify(self, st: SpecState, drafted: int, accepted: int) -> None:
        st.misses = 0
        st.verify_ct += 1
        st.drafted += drafted
        st.accepted += accepted
        st.recent.append((accepted, int(accepted < drafted)))
        if st.backoff and 2 * accepted >= drafted:  # drafts that pay: the next auto-off is shorter
            st.backoff //= 2
