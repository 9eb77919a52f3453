"""A hybrid SWA L1 (hicache/tiers/window_pages.py) under tensor parallelism: every rank's sliding layers
keep the same pages' windows in the same window pages.

Rank 0 decides (its request cache assigns, trims, moves and drops window pages; its allocator resets a
reused page's entry). :func:`record_map` swaps rank 0's map for a list that also notes each entry written
(the last value per page), and the leader sends the notes, as one ``WindowMap`` command, before its next
command (serving/tp/leader.py). A follower applies them to its own pool's map (:class:`MapMirror`),
so at every command its map is rank 0's at the time the command was sent: its page mover backs up and
loads the same window pages (and sets the same L2 ``sliding_valid`` flags), and each forward batch's
window view (the batch's page table and store locations in window pages, as rank 0's ``set_window``
makes them) is built from the batch's host buffers and that map (:meth:`MapMirror.window_view`).

Concurrency: rank 0's map and notes on the scheduler thread only (the pool's owner); a follower's
mirror on its command thread only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch


class _NotedMap(list):
    """A window map whose item writes are also noted in ``notes`` (page -> its latest window page)."""

    def __init__(self, entries: list[int], notes: dict[int, int]) -> None:
        super().__init__(entries)
        self.notes = notes

    def __setitem__(self, i, v) -> None:  # noqa: ANN001 (int index, as WindowPages writes)
        if not isinstance(i, int):
            raise TypeError("the window map is written one page at a time")
        list.__setitem__(self, i, v)
        self.notes[i] = v


def record_map(windows: Any, notes: dict[int, int]) -> None:
    """Note every write to ``windows.map`` (a WindowPages) in ``notes`` from now on."""
    windows.map = _NotedMap(windows.map, notes)


def take_notes(notes: dict[int, int]) -> tuple[np.ndarray, np.ndarray] | None:
    """The noted (pages, window pages), cleared; None when nothing was written."""
    if not notes:
        return None
    pages = np.fromiter(notes.keys(), dtype=np.int64, count=len(notes))
    values = np.fromiter(notes.values(), dtype=np.int64, count=len(notes))
    notes.clear()
    return pages, values


def map_digest(windows: Any) -> int:
    """A digest of a hybrid SWA L1's window map (0 without one): equal on every rank when they agree."""
    return 0 if windows is None else hash(tuple(windows.map))


class MapMirror:
    """A follower's copy of rank 0's window map: its pool's ``windows.map`` (what its page mover reads)
    and the same as an array (what a batch's window view is built from)."""

    def __init__(self, windows: Any) -> None:
        self.windows = windows
        self.array = np.full(len(windows.map), -1, dtype=np.int64)

    def apply(self, pages: np.ndarray, values: np.ndarray) -> None:
        self.array[pages] = values
        m = self.windows.map
        for p, v in zip(pages.tolist(), values.tolist(), strict=True):
            m[p] = v

    def window_view(self, fb: Any, i64: np.ndarray, i32: np.ndarray) -> None:
        """``fb.win``: the sliding layers' view of ``fb`` (built from host buffers ``i64`` / ``i32``, as
        ForwardBatch.build lays them out), as rank 0's ``set_window`` made it from the same map."""
        t, b, width, ps = fb.num_tokens, fb.batch_size, fb.page_table.shape[1], fb.page_size
        table = i32[4 * b: 4 * b + b * width].astype(np.int64).reshape(b, width)
        locs = i64[2 * t: 3 * t]
        win_table = np.maximum(self.array[table], 0).astype(np.int32)
        used = -(-i32[2 * b: 3 * b].astype(np.int64) // ps)  # pages a sequence's tokens are in; the rest: padding
        win_table[np.arange(width)[None, :] >= used[:, None]] = 0
        wins = self.array[locs // ps]
        if (wins < 0).any():
            raise RuntimeError("a forward batch stores into a page without a window page on this rank "
                               "(its window map is not rank 0's)")
        win_locs = wins * ps + locs % ps
        dev = fb.input_ids.device
        fb.win = dataclasses.replace(fb, page_table=torch.from_numpy(win_table).to(dev),
                                     out_cache_loc=torch.from_numpy(win_locs).to(dev), host=None, win=None)
