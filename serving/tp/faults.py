"""A tensor-parallel engine's faults: what a dead rank's error says, and the process's one group.

- :class:`RankDied`: the offline engine's calls raise it once a rank is gone (the server's engine
  process exits instead: serving/tp/leader.py). Its message names the rank, its exit code
  (-9: killed, e.g. by the OOM killer) and the end of the traceback the rank wrote before it exited
  (:func:`write_error`: a file in the engine's own temporary folder) or, for a crash in native code
  (-11: SIGSEGV), the stacks ``faulthandler`` wrote there (:func:`open_crash_log`), so a failure seen
  only through rank 0 (a collective's "Connection reset by peer") says why.
- One tensor-parallel engine per process: torch's default process group is the process's. A group
  left by an engine whose rank died (and that was never shut down) is destroyed when the next
  engine starts (:func:`claim_group`); a live engine's is not: the next one is refused, naming it.
"""

from __future__ import annotations

import os
import traceback
import weakref
from typing import Any

import torch.distributed as dist

ERROR_TAIL = 2000  # characters of a rank's traceback kept in the message


class RankDied(RuntimeError):
    """A tensor-parallel rank died; the offline engine cannot run another forward pass."""


def error_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.err")


def open_crash_log(path: str | None) -> Any:
    """At a rank's start: ``path`` opened for ``faulthandler`` (kept open for the process's life), so a
    crash in native code, which runs no ``except`` block, still leaves the stacks of every thread
    there for :func:`death_reason`; None when it cannot be opened (best effort)."""
    if path is None:
        return None
    try:
        return open(path, "w")  # noqa: SIM115 - faulthandler writes to its descriptor until the process ends
    except OSError:
        return None


def write_error(path: str | None) -> None:
    """In a rank's ``except`` block: its traceback, for rank 0's message (best effort)."""
    if path is None:
        return
    try:
        with open(path, "w") as f:
            f.write(traceback.format_exc())
    except OSError:
        pass


def death_reason(rank: int, proc: Any, err: str | None) -> str:
    """``tensor-parallel rank r (pid p) exited with code c`` and the end of its traceback, if it left one."""
    why = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
    try:
        with open(err) as f:  # type: ignore[arg-type]
            text = f.read()
        # a traceback's end names the error; faulthandler's report starts with it (its stacks follow,
        # then a long list of extension modules)
        tail = (text[:ERROR_TAIL] if text.startswith("Fatal Python error") else text[-ERROR_TAIL:]).strip()
    except (OSError, TypeError):
        tail = ""
    return f"{why}: {tail}" if tail else why


_owner: weakref.ref | None = None  # the engine (rank 0) whose group is this process's default group


def claim_group(owner: Any) -> None:
    """Before ``owner`` (a TPLeader) creates the default group: destroy one left by a dead or dropped
    engine; refuse while another live engine holds it."""
    global _owner
    if dist.is_initialized():
        prev = _owner() if _owner is not None else None
        if prev is not None and prev is not owner and prev.dead is None and not prev.stopping:
            raise RuntimeError("a tensor-parallel engine is already running in this process (one per process: "
                               "torch's default process group); shut it down first")
        dist.destroy_process_group()
    _owner = weakref.ref(owner)
