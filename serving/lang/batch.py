"""How ``run_batch`` makes a shared prefix be computed once: the prefix gate.

Every program of a batch passes its first call through one :class:`PrefixGate`. The first
program whose text shares no long prefix (``min_chars``) with a group already seen leads a new
group: it sends its text as a prefill-only request (the radix tree then holds it) and opens the
gate for that group; programs that share the prefix wait only for that prefill, then send
their calls together, each finding the shared part cached. Programs of different groups (two
few-shot headers, say) do not wait for each other, and once a group's prefill is done its
later programs pass straight through.

Concurrency contract: ``enter`` is called from the programs' worker threads; the group list
is guarded by ``lock``; a leader's event is set exactly once (``release``), also when its
prefill failed, so no program waits forever.
"""

from __future__ import annotations

import os
import threading

MIN_SHARED_CHARS = 64


class PrefixGate:
    def __init__(self, min_chars: int = MIN_SHARED_CHARS) -> None:
        self.min_chars = min_chars
        self.lock = threading.Lock()
        self.groups: list[tuple[str, threading.Event]] = []

    def enter(self, text: str) -> threading.Event | None:
        """Wait while a program sharing ``text``'s prefix is prefilling it. Returns an event to
        set (via :meth:`release`) when this program leads a new group, else None."""
        while True:
            with self.lock:
                pending, seen = None, False
                for t, ev in self.groups:
                    if len(os.path.commonprefix([t, text])) >= self.min_chars:
                        seen = True
                        if not ev.is_set():
                            pending = ev
                            break
                if pending is None:
                    if seen:
                        return None
                    ev = threading.Event()
                    self.groups.append((text, ev))
                    return ev
            pending.wait()

    @staticmethod
    def release(ev: threading.Event | None) -> None:
        if ev is not None:
            ev.set()
