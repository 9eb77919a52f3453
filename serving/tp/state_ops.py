"""A state model's L1 state pool writes outside a forward pass, under tensor parallelism.

Rank 0 zeroes a request's working slot, or copies its match's snapshot into it, at admission
(serving/cache/request_states.py). The followers must do the same to their pools (each holds its own
heads' state) in the same place of the command stream: :func:`record_writes` wraps rank 0's pool so
each such write is also appended to a list, which the leader sends as one ``StateOps`` command before
its next command; :func:`apply_ops` runs them on a follower. A write of host bytes (``write_slot``: rank
0's heads only) cannot be mirrored so and raises.

Concurrency: the scheduler thread only (it owns the pool and the list), as the pool's contract says.
"""

from __future__ import annotations

from typing import Any


def record_writes(pool: Any, ops: list[tuple[str, int, int]]) -> None:
    """Wrap ``pool`` (a DeviceStatePool; this instance only): ``zero_slot`` / ``copy_slot`` append
    ``("zero", slot, -1)`` / ``("copy", src, dst)`` to ``ops``, then run."""
    zero, copy = pool.zero_slot, pool.copy_slot

    def tp_zero(slot: int) -> None:
        ops.append(("zero", slot, -1))
        zero(slot)

    def tp_copy(src: int, dst: int) -> None:
        ops.append(("copy", src, dst))
        copy(src, dst)

    def tp_write(slot: int, tensors: Any) -> None:
        raise RuntimeError("write_slot into the L1 state pool is not mirrored to the other tensor-parallel "
                           "ranks (each holds its own heads' state)")

    pool.zero_slot, pool.copy_slot, pool.write_slot = tp_zero, tp_copy, tp_write


def apply_ops(pool: Any, ops: list[tuple[str, int, int]]) -> None:
    """Run rank 0's recorded writes on this rank's pool, in order."""
    for op, a, b in ops:
        if op == "zero":
            pool.zero_slot(a)
        elif op == "copy":
            pool.copy_slot(a, b)
        else:
            raise ValueError(f"unknown state op {op!r}")
