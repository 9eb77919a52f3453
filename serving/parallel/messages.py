"""What rank 0 sends the other tensor-parallel ranks (pickled over a multiprocessing pipe).

Command pipe (followers run them in order on their main thread): ``Forward`` (a forward
batch's host buffers), ``Moves`` (L1 <-> L2 page copies the tree emitted), ``Stop``. Every
command advances a sequence number. Storage pipe (a follower thread answers; rank 0 waits):
``L3Get`` / ``L3Set`` with the rank's own keys; each names the command sequence number it
must follow (``after``), so a page is read for L3 only once its L1 -> L2 backup has run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Setup:
    """First command: the page counts rank 0 chose (so every rank's page ids mean the same)."""

    host_pages: int


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


@dataclass(frozen=True)
class Moves:
    """Tier moves in order: (kind "backup" (L1 -> L2) or "load" (L2 -> L1), src pages, dst pages)."""

    moves: list[tuple[str, list[int], list[int]]]


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
class Check:
    """check_integrity: the follower answers, once it has run command ``after`` or after
    ``wait_s`` seconds, with ``(commands run, L1 pages, L2 pages)``."""

    after: int
    wait_s: float
