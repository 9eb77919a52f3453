"""What drafts cost, measured on the running engine (DraftPolicy's cost terms).

A decode step of ``B`` rows takes ``a_B`` seconds. A step with ``K`` drafts in all takes
``a_B + f + b K``: ``f`` once (on a CPU a multi-token matmul packs the weights as a
matrix-vector product does not, and the batch leaves the decode kernels), ``b`` per draft. From a
request's point of view a step costs its share ``a_B / B``, so ``k`` drafts of its own cost it
``1 + c0 + c1 k`` steps with ``c0 = f / a_B`` (charged in full to every drafting request: an upper
bound when several draft) and ``c1 = b B / a_B``: small on a GPU at batch 1, larger on a CPU and
with the batch.

Measured from the steps themselves (wall time of decode steps without prefill chunks), per batch
bucket (1, 2-3, 4-7, ...): ``a_B`` an exponential moving average of the steps without drafts;
``f`` and ``b`` a least-squares line through the excess time of the steps with drafts against
their draft count, exponentially weighted. A line needs counts that vary; until they do, the
excess is split with ``c1`` at most ``prior`` and the rest fixed, which keeps the drafts of a
request whose drafts are accepted long (so its counts grow and the line gets measured) instead
of locking speculation off after a few short probes on a noisy machine. Where a bucket has had
no step without drafts for ``probe_every`` steps, :meth:`wants_plain` asks for one, so the
estimate follows the machine (its load, the quantization, the device) rather than a constant. A
bucket with fewer than ``MIN_SAMPLES`` steps of each kind borrows the nearest measured bucket's
seconds (its step taken as growing with its rows); with none measured, ``prior`` (as ``c1``)
stands in.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SAMPLES = 3  # steps with drafts (and one without) before a bucket's own terms are used


@dataclass
class _Bucket:
    batch: int = 1  # the last batch size observed in it
    plain: float = 0.0  # EMA of a plain decode step's seconds (0: none yet)
    # exponentially weighted sums over steps with drafts: weight, x = drafts, y = excess seconds
    s0: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    since_plain: int = 0  # steps with drafts since the last plain one

    def line(self) -> tuple[float, float, float] | None:
        """(f, b, mean drafts): fixed and per-draft seconds; None while the counts hardly vary
        (then ``(mean excess, mean drafts)`` from :meth:`means`)."""
        mx, my = self.sx / self.s0, self.sy / self.s0
        var = self.sxx / self.s0 - mx * mx
        if var < 0.25 or mx <= 0:
            return None
        b = max(0.0, (self.sxy / self.s0 - mx * my) / var)
        return max(0.0, my - b * mx), b, mx

    def means(self) -> tuple[float, float]:
        return self.sy / self.s0, self.sx / self.s0


class StepCost:
    def __init__(self, prior: float, decay: float = 0.95, probe_every: int = 64, adaptive: bool = True) -> None:
        """``adaptive=False``: ``prior`` always (tests that want every draft the policy allows)."""
        self.prior = prior
        self.decay = decay
        self.probe_every = probe_every
        self.adaptive = adaptive
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch: int) -> _Bucket:
        return self._buckets.setdefault(batch.bit_length(), _Bucket())

    def terms(self, batch: int) -> tuple[float, float]:
        """(c0, c1) for a request in a decode step of ``batch`` rows (see the module doc)."""
        if not self.adaptive:
            return 0.0, self.prior
        key = batch.bit_length()
        measured = [k for k, b in self._buckets.items() if b.plain and b.s0 >= MIN_SAMPLES * 0.9]
        if not measured:
            return 0.0, self.prior
        ref = self._buckets[min(measured, key=lambda k: abs(k - key))]  # itself when measured
        own = self._buckets.get(key)
        a = own.plain if own is not None and own.plain else ref.plain * batch / ref.batch  # a step ~ its rows
        line = ref.line()  # seconds: about the same whatever the batch
        if line is None:
            my, mx = ref.means()
            c1 = min(self.prior, my * batch / (a * mx)) if mx > 0 else self.prior
            return min(4.0, max(0.0, my / a - c1 * mx / batch)), max(0.001, c1)
        f, per, _ = line
        return min(4.0, f / a), min(4.0, max(0.001, per * batch / a))

    def wants_plain(self, batch: int) -> bool:
        """Whether this step should run without drafts to measure a plain step."""
        b = self._bucket(batch)
        if not self.adaptive:
            return False
        return b.since_plain >= self.probe_every or (not b.plain and b.since_plain >= 4)

    def observe(self, batch: int, drafts: int, seconds: float) -> None:
        """A decode step of ``batch`` rows and ``drafts`` drafts in all took ``seconds``."""
        b = self._bucket(batch)
        b.batch = batch
        if drafts == 0:
            b.plain = seconds if not b.plain else b.plain + 0.1 * (seconds - b.plain)
            b.since_plain = 0
            return
        b.since_plain += 1
        if not b.plain:
            return
        y = min(max(0.0, seconds - b.plain), 4 * b.plain)  # an outlier (a descheduled step) counts as 4 steps
        d = self.decay
        b.s0, b.sx, b.sy = d * b.s0 + 1, d * b.sx + drafts, d * b.sy + y
        b.sxx, b.sxy = d * b.sxx + drafts * drafts, d * b.sxy + drafts * y

    def snapshot(self) -> dict[str, float]:
        out = {}
        for key in sorted(self._buckets):
            c0, c1 = self.terms(1 << (key - 1))
            out[f"cost_b{1 << (key - 1)}_fixed"], out[f"cost_b{1 << (key - 1)}_per_draft"] = c0, c1
        return out
