"""The engine loop's side of the watchdog: it stamps the heartbeat (serving.ipc's slots, in
shared memory) once per turn; the HTTP process reads it (serving.server.watchdog)."""

from __future__ import annotations

import time

from serving.ipc import BEAT, BUSY, FORWARD_PASSES, PROGRESS, Heartbeat


class HeartbeatWriter:
    """The engine loop's side: ``beat()`` once per turn of the loop (the loop thread alone
    writes; no lock, see serving.server.watchdog)."""

    def __init__(self, hb: Heartbeat | None) -> None:
        self.hb = hb

    def beat(self, busy: bool, progressed: bool, forward_passes: int) -> None:
        hb = self.hb
        if hb is None:
            return
        now = time.monotonic()
        if progressed or not busy:
            hb[PROGRESS] = now
        hb[BEAT] = now
        hb[BUSY] = 1.0 if busy else 0.0
        hb[FORWARD_PASSES] = float(forward_passes)
