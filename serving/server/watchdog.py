"""The engine watchdog: a heartbeat the engine process writes into shared memory and the HTTP
process reads, so that ``/health`` tells whether the engine is making progress.

The heartbeat is four doubles (a ``multiprocessing`` RawArray, no lock: each slot is written
by the engine alone, and a torn read at worst misjudges one check); its slots (``PROGRESS``,
``BEAT``, ``BUSY``, ``FORWARD_PASSES``) and ``make_heartbeat`` are in serving.ipc, the writer
in serving.engine.heartbeat. This module is the HTTP side's reading of it.

``time.monotonic()`` is the system-wide CLOCK_MONOTONIC on Linux, so both processes read the
same clock. The HTTP side (``EngineClient.stall_s``) calls the engine stalled once either
measure passes ``watchdog_timeout`` seconds:

- ``stall_seconds``: no progress while work is pending (requests or calls the HTTP side
  waits on, or requests the engine itself holds): a loop that turns without moving;
- ``silence_seconds``: the loop has not turned at all, whether or not work is pending. An
  idle loop waits for messages at most a second at a time, so a healthy idle engine beats
  about once a second; a frozen one (SIGSTOP, a deadlock, a native call that never returns)
  is noticed without anyone asking it anything. One forward pass longer than the timeout
  counts as a stall too.
"""

from __future__ import annotations

import time
from typing import Any

from serving.ipc import BEAT, BUSY, PROGRESS


def stall_seconds(hb: Any | None, waiting_since: float | None, now: float | None = None) -> float:
    """How long the engine has made no progress while work is pending; 0.0 when nothing is.

    ``waiting_since``: since when the HTTP side has been waiting on the engine without a
    break (None: it waits on nothing). A stall is counted from the later of that moment and
    the engine's last progress, so an engine stopped while idle is not blamed for the time
    before anyone asked it for something.
    """
    if hb is None:
        return 0.0
    engine_busy = hb[BUSY] > 0.0
    if waiting_since is None and not engine_busy:
        return 0.0
    start = hb[PROGRESS]
    if waiting_since is not None:
        start = max(start, waiting_since)
    return max(0.0, (time.monotonic() if now is None else now) - start)


def silence_seconds(hb: Any | None, now: float | None = None) -> float:
    """How long ago the engine's loop last went round (0.0 without a heartbeat)."""
    if hb is None:
        return 0.0
    return max(0.0, (time.monotonic() if now is None else now) - hb[BEAT])
