"""A waiting request's L3 prefetch (``Req.kv.prefetch``; serving/cache/l3_prefetch.py's ``Prefetcher`` owns
and drives it): what it pins, its lookup, the fetch it holds, and when that fetch stops paying off."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from hicache.hiradix.node import TreeNode
from serving.cache.l3_fetch import FetchOp
from serving.cache.prefetch_policy import LoadBudget


@dataclass
class PrefetchOp:
    """A request's prefetch while it waits: its cached prefix it holds and the L2 pages of it it pins, its
    lookup, then the fetch it holds (its own or one it follows). Without a lookup it only
    keeps its cached prefix in L2 (``watching``)."""

    start_page: int  # first prompt page looked for in L3 (the cached prefix ends here)
    tokens: list[int]  # the prompt's full pages
    deadline: float
    lookup: Future | None = None  # -> pages present in L3 from start_page on (None: watching)
    pinned: list[int] = field(default_factory=list)  # L2 pages of the cached prefix pinned until finish
    held: TreeNode | None = None  # where the cached prefix ends, held (tree.hold) until finish
    keys: list[str] = field(default_factory=list)  # set by the lookup thread
    cancel: threading.Event = field(default_factory=threading.Event)
    fetch: FetchOp | None = None  # held from the fetch's start until finish
    offset: int = 0  # index of keys[0] in the fetch's keys (0 unless it follows another request's)
    need: int = 0  # leading keys of this request the fetch reads
    room_wait_since: float = 0.0  # when it first found L2 full (0: never)
    waits_for_room: bool = False  # its fetch did not start at its last try: L2 or host window room is held
    # a state model's snapshot from L3: (the deepest stored, its page from start_page; the read of the deepest
    # good one: StateStore.find_deepest's answer)
    state: tuple[int, Future] | None = None
    budget: LoadBudget | None = None  # when its fetch stops paying off (None: the load policy cannot tell)
    cut: bool = False  # its fetch fell behind recompute: the request went with what had landed

    @property
    def watching(self) -> bool:
        return self.lookup is None and self.fetch is None

    @property
    def loaded(self) -> int:
        """Of this request's pages, how many leading ones have landed."""
        if self.fetch is None:
            return 0
        return max(0, min(self.fetch.loaded - self.offset, self.need))

    @property
    def reading(self) -> int:
        """Of this request's pages, how many leading ones its fetch's readers have started on."""
        if self.fetch is None:
            return 0
        return max(0, min(self.fetch.reading - self.offset, self.need))

    @property
    def fetched(self) -> bool:
        """Its part of the fetch is in (or the fetch has ended), and its snapshot's read (a state model)."""
        return self.fetch is not None and (self.fetch.done or self.loaded >= self.need) and \
            (self.state is None or self.state[1].done())
