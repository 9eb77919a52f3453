"""The grammar compile worker: a child process that tries compiles so that one can be killed.

A compile in xgrammar cannot be interrupted, and some small grammars take minutes (``(a|b)*``
repeated 400 times: ~20 s, growing quadratically). So every new grammar is first compiled
here, in a process the engine kills when the compile runs past its time budget (or when
every request waiting for it is aborted); only a grammar that compiled here within the
budget is then compiled in the engine process (see ``compile_pool``). The compiled grammar
itself is not sent back: xgrammar's only serialization is JSON, which for some grammars is
hundreds of times the grammar's memory (a 22 KB schema of integer ranges: 3.5 MB compiled,
593 MB of JSON, 40 s to write), while compiling again takes as long as compiling here did.

Run as ``python -m serving.grammar.compile_worker PARENT_PID``. The protocol, frames of a
4-byte big-endian length and a msgpack body, stdin -> worker, worker -> stdout:

- in:  ``{"factory": "module:function", "config": ..., "max_memory_mb": n}`` once, then
  ``[job_id, kind, text]``;
- out: ``["ready"]`` once the factory has built its compile function, then
  ``[job_id, True, seconds]`` or ``[job_id, False, message, reason]`` per job (reason
  ``"memory"``: the worker ran out of its address space, see below; ``"error"`` otherwise).

Memory: the engine measures the worker's peak RSS against ``max_memory_mb`` over its idle
size (``compile_pool``). That is read every few ms, so the worker also limits its own address
space (RLIMIT_AS, once ready) to its size then plus twice ``max_memory_mb`` plus a headroom
(``memory_limits``): an allocation faster than the engine's reads fails there, the trial is
answered ``"memory"`` and the engine replaces the worker.

The worker runs at a lower CPU priority than the engine, ignores SIGINT / SIGTERM (the engine
stops it), and dies with its parent (``PR_SET_PDEATHSIG`` on Linux, and EOF on stdin).
"""

from __future__ import annotations

import importlib
import os
import signal
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import msgpack

from serving.grammar.base import GrammarError
from serving.grammar.memory_limits import is_out_of_memory, limit_address_space

NICE = 5  # compiles yield the CPU to the engine's forward passes
WARM_UP = ("regex", "[0-9]{3}")  # compiled once before "ready": the idle size includes the compiler's threads
MAX_FRAME = 64 * 2**20  # messages are small (a grammar's text, a config with a tokenizer's vocabulary)
_LEN = struct.Struct(">I")


def write_frame(fd: int, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int) -> Any:
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size))
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes is over the limit of {MAX_FRAME}")
    return msgpack.unpackb(_read_exact(fd, n), raw=False)


def load_factory(path: str) -> Callable[[Any], Callable[[str, str], Any]]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(0)


def main() -> None:
    _die_with_parent(int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.nice(NICE)
    except OSError:
        pass
    rx, tx = 0, os.dup(1)
    os.dup2(2, 1)  # anything printed goes to stderr, never into the reply pipe
    init = read_frame(rx)
    compile_fn = load_factory(init["factory"])(init["config"])
    try:
        compile_fn(*WARM_UP)
    except Exception:
        pass
    if init.get("max_memory_mb"):
        limit_address_space(int(init["max_memory_mb"]))
    write_frame(tx, ["ready"])
    while True:
        try:
            job_id, kind, text = read_frame(rx)
        except EOFError:
            return
        t0 = time.perf_counter()
        try:
            compile_fn(kind, text)
        except Exception as e:  # GrammarError names the problem; anything else is named by its type
            if is_out_of_memory(e):
                write_frame(tx, [job_id, False, "out of memory", "memory"])
                os._exit(3)  # the engine replaces this worker
            msg = str(e) if isinstance(e, GrammarError) else f"{type(e).__name__}: {e}"
            write_frame(tx, [job_id, False, msg[:1000], "error"])
        else:
            write_frame(tx, [job_id, True, time.perf_counter() - t0])


if __name__ == "__main__":
    main()
