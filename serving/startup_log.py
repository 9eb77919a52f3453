"""Start-up steps that take a while say what they do and how long it took (one line when they
start, one when they are done): weight loading, kernel builds, CUDA graph capture; the L2
allocation logs its own (hicache.tiers.host_pinning pins in the background)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("hicache.startup")


@contextmanager
def timed(what: str, logger: logging.Logger = log) -> Iterator[None]:
    logger.info("%s ...", what)
    t0 = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what, time.perf_counter() - t0)
