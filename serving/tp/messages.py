"""What rank 0 sends the other tensor-parallel ranks (pickled over a multiprocessing pipe).

Command pipe (followers run them in order on their main thread): ``Forward`` (a forward
batch's host buffers, and a state model's slots), ``Moves`` (L1 <-> L2 page copies and state
snapshot copies the tree emitted), ``StateOps`` (the L1 state slot zeroing and copies rank 0 made
since the last command), ``StateLoad`` (the rank's part of a snapshot read from L3, into an L2 state
slot), ``WindowMap`` (a hybrid SWA L1's window map entries rank 0 wrote since the last command),
``Stop``. Every command advances a sequence number. Storage pipe (a follower thread answers;
rank 0 waits): ``L3Get`` / ``L3Set`` with the rank's own keys, ``L3StateSet`` (the rank's part of a
snapshot); each names the command sequence number it must follow (``after``), so a page or a
snapshot is written to L3 only once its L1 -> L2 backup has run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Setup:
    """First command: the page counts rank 0 chose (so every rank's page ids mean the same), and a
    state model's L1 / L2 state slot counts (slot ids too)."""

    host_pages: int
    state_slots: int = 0
    host_state_slots: int = 0


@dataclass(frozen=True)
class Forward:
    i64: np.ndarray
    i32: np.ndarray
    t: int
    b: int
    width: int
    page_size: int
    prefix_lens: list[int]
    extend_lens: list[int]
    logit_rows: list[int] | None
    ids_from_rank0: bool = False  # overlap scheduling: the ids hold placeholders; rank 0 broadcasts the real ones
    state: tuple[list[int], list[int], list[int]] | None = None  # state_slots, snap_slots, snap_offsets


@dataclass(frozen=True)
class Moves:
    """Tier moves in order: (kind "backup" (L1 -> L2), "load" (L2 -> L1), "state_backup" or
    "state_load" (state slots), src pages or slots, dst pages or slots)."""

    moves: list[tuple[str, list[int], list[int]]]


@dataclass(frozen=True)
class StateOps:
    """L1 state slot writes in order: ("zero", slot, -1) or ("copy", src, dst) (a request's working
    slot at admission: zeros, or its match's snapshot)."""

    ops: list[tuple[str, int, int]]


@dataclass(frozen=True)
class StateLoad:
    """L2 state slot ``slot`` := ``payload`` (this rank's part of a snapshot rank 0 read from L3)."""

    slot: int
    payload: bytes  # bytes-like: a numpy uint8 array from L3 (pickled as its bytes)


@dataclass(frozen=True)
class WindowMap:
    """A hybrid SWA L1's window map: logical page ``pages[i]`` -> window page ``values[i]`` (-1: none),
    rank 0's writes since the last command (serving/parallel/window_map.py)."""

    pages: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class L3Get:
    after: int
    keys: list[str]
    pages: list[int]


@dataclass(frozen=True)
class L3Set:
    after: int
    keys: list[str]
    pages: list[int]


@dataclass(frozen=True)
class L3StateSet:
    """Store this rank's part of L2 state slot ``slot`` as the snapshot after the page keyed ``page_key``
    (rank 0's key; the part's key is derived from it); the answer is 1 when it is on L3."""

    after: int
    page_key: str
    slot: int


@dataclass(frozen=True)
class Check:
    """check_integrity: the follower answers, once it has run command ``after`` or after
    ``wait_s`` seconds, with ``(commands run, L1 pages, L2 pages, L1 state slots, L2 state slots, window
    map digest)``."""

    after: int
    wait_s: float
