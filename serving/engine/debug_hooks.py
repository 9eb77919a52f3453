"""Hooks for tests, read from the environment once; unset (as in production) they cost nothing.

``HICACHE_TEST_HOLD_STEP``: a file path. While that file exists, each engine step waits before
its forward pass, as a long pass would (the loop thread is busy, the heartbeat does not beat,
the receiver thread still reads the pipe), so a test can hold the engine in a "forward pass"
for exactly as long as it needs, deterministically. Logged once per hold.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("hicache.engine")
HOLD_ENV = "HICACHE_TEST_HOLD_STEP"


class StepHold:
    def __init__(self, environ: os._Environ[str] | dict[str, str] = os.environ) -> None:
        self.path = environ.get(HOLD_ENV) or None

    def wait(self) -> None:
        """Before a step: wait while the file exists (sleeping, so the GIL is free, as in a pass)."""
        if self.path is None or not os.path.exists(self.path):
            return
        log.warning("%s: step held while %s exists", HOLD_ENV, self.path)
        while os.path.exists(self.path):
            time.sleep(0.01)
