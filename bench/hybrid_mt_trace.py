"""Where a returning turn's time goes: a per-step trace of bench/hybrid_mt_probe.py's multi-turn run, or of
bench/hybrid.py's TTFT section (``--ttft``).

    python3 bench/hybrid_mt_trace.py OUT.json [--ttft] [probe / hybrid.py arguments, e.g. --small --device cpu]

Each scheduler step: its wall time and, inside it, the time of ``_plan`` (admission: matches, loads,
reservations, the waiting requests' prefetches), ``_forward`` (the launch) and ``_commit`` (sampling: the
wait for the GPU); whether it ran a forward pass and its prefill tokens; the running requests and the
waiting ones by prefetch state (``lookup``, ``room``: a fetch waiting for L2 or window room, ``reading``,
``landed``, ``watch``: nothing to fetch); free pages of L1, the L1 window pool, the host window pool and
L2. The summary per turn (or per ``generate`` call with ``--ttft``) sums them. A diagnostic: it wraps the
scheduler's methods, so the times include its own small overhead.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench.gpu_tiers_sections as sections  # noqa: E402
import serving.engine.offline as offline  # noqa: E402
import serving.scheduler.scheduler as scheduler  # noqa: E402

PHASES = ("_plan", "_forward", "_commit")


def prefetch_state(r) -> str:  # noqa: ANN001 (a Req)
    op = r.kv.prefetch
    if op is None:
        return "checked" if r.kv.prefetch_checked else "none"
    if op.watching:
        return "watch"
    if op.fetch is None:
        return "lookup" if op.lookup is not None and not op.lookup.done() else "room"
    return "landed" if op.fetched else "reading"


class Trace:
    """Installs the wrappers; ``steps`` (one dict a step), ``marks`` (step index at each timed turn),
    ``calls`` (each ``generate``: start, seconds, its steps)."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.marks: list[int] = []
        self.calls: list[dict] = []
        self._phase: dict[str, float] = collections.defaultdict(float)
        for name in PHASES:
            setattr(scheduler.Scheduler, name, self._timed_phase(getattr(scheduler.Scheduler, name), name))
        step, timed, generate = scheduler.Scheduler.step, sections.timed, offline.Engine.generate
        trace = self

        def traced_step(sched):  # noqa: ANN001
            trace._phase.clear()
            t0 = time.perf_counter()
            f0 = sched.stats.forward_passes
            out = step(sched)
            trace.steps.append(trace._record(sched, t0, time.perf_counter() - t0, sched.stats.forward_passes - f0))
            return out

        def traced_timed(eng, hist):  # noqa: ANN001
            trace.marks.append(len(trace.steps))
            return timed(eng, hist)

        def traced_generate(eng, *a, **kw):  # noqa: ANN001
            t, i = time.perf_counter(), len(trace.steps)
            try:
                return generate(eng, *a, **kw)
            finally:
                trace.calls.append({"t": t, "dt": time.perf_counter() - t, "steps": [i, len(trace.steps)]})

        scheduler.Scheduler.step = traced_step
        sections.timed = traced_timed
        offline.Engine.generate = traced_generate

    def _timed_phase(self, f, name: str):  # noqa: ANN001, ANN202
        def g(sched, *a, **kw):  # noqa: ANN001
            t = time.perf_counter()
            try:
                return f(sched, *a, **kw)
            finally:
                self._phase[name] += time.perf_counter() - t
        return g

    def _record(self, sched, t0: float, dt: float, fwd: int) -> dict:  # noqa: ANN001
        c = sched.cache
        rw = c.windows
        hw = rw.host.windows if rw is not None and rw.host is not None else None
        return {"t": t0, "dt": dt, **{k: round(v, 5) for k, v in self._phase.items()}, "fwd": fwd,
                "prefill": sched._step_prefill, "running": len(sched.running),
                "waiting": dict(collections.Counter(prefetch_state(r) for r in sched.waiting)),
                "l1_free": c.allocator.num_free, "win_free": rw.windows.num_free if rw is not None else None,
                "hwin_free": hw.num_free if hw is not None else None, "host_free": c.tree.host.num_free}


def summary(steps: list[dict]) -> dict:
    wall = steps[-1]["t"] + steps[-1]["dt"] - steps[0]["t"] if steps else 0.0
    return {"steps": len(steps), "wall": round(wall, 3), "fwd_steps": sum(1 for r in steps if r["fwd"]),
            "idle_steps_s": round(sum(r["dt"] for r in steps if not r["fwd"]), 3),
            "between_steps_s": round(wall - sum(r["dt"] for r in steps), 3),
            "prefill_tokens": sum(r["prefill"] for r in steps),
            **{k: round(sum(r.get(k, 0) for r in steps), 3) for k in PHASES}}


def main() -> None:
    out, rest = sys.argv[1], sys.argv[2:]
    trace = Trace()
    if "--ttft" in rest:
        rest.remove("--ttft")
        import bench.hybrid as hybrid

        sys.argv = ["hybrid.py", "--models", "gemma3", "--sections", "ttft", "--swa-full-tokens-ratio", "0.2",
                    "--json", out + ".ttft.json", *rest]
        hybrid.main()
        parts = [trace.steps[a:b] for a, b in (c["steps"] for c in trace.calls)]
        rows = [{"generate_s": round(c["dt"], 4), **summary(p)} for c, p in zip(trace.calls, parts, strict=True)]
    else:
        import bench.hybrid_mt_probe as probe

        sys.argv = ["hybrid_mt_probe.py", "--json", out + ".probe.json", *rest]
        probe.main()
        bounds = [*trace.marks, len(trace.steps)]
        rows = [summary(trace.steps[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    for r in rows:
        print(r)
    with open(out, "w") as f:
        json.dump({"summary": rows, "steps": trace.steps, "marks": trace.marks, "calls": trace.calls}, f)


if __name__ == "__main__":
    main()
