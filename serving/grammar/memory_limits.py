"""Memory budgets of the grammar compile workers (``compile_pool``, ``compile_worker``): what a
process holds (read from /proc by the engine) and the hard address-space limit a worker sets
itself. Linux only; elsewhere the reads return None and the limit is not set (the time budget
remains)."""

from __future__ import annotations

AS_HEADROOM = 256 * 2**20  # thread stacks and malloc arenas reserve address space they barely touch


def memory_bytes(pid: int, field: str = "VmHWM") -> int | None:
    """A process's memory from /proc/PID/status: ``VmHWM`` its peak resident size so far (a
    peak between two reads is seen), ``VmRSS`` its resident size now; None where unknown."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(field.encode() + b":"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None


def limit_address_space(max_memory_mb: int) -> None:
    """This process's RLIMIT_AS at its address space now + 2 * ``max_memory_mb`` + AS_HEADROOM
    (a lower limit it inherited stays)."""
    try:
        import resource

        with open("/proc/self/status", "rb") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"VmSize:"))
        limit = size + 2 * max_memory_mb * 2**20 + AS_HEADROOM
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            limit = min(limit, soft)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, OSError, StopIteration, ValueError):
        pass


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: Python's MemoryError, or C++'s std::bad_alloc as xgrammar
    raises it (a RuntimeError, maybe wrapped in a GrammarError)."""
    return any(isinstance(x, MemoryError) or "bad_alloc" in str(x) for x in (e, e.__context__) if x is not None)
