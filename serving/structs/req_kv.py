"""A request's KV: the record of what the cache holds for one request.

The class lives here, at the bottom of the engine's import graph, so that ``Req`` can hold one
(``Req.kv``) without importing ``serving.cache``; its fields belong to ``serving/cache``:
**only ``serving/cache`` writes them** (``ReqCache`` -- admission, reservation, advancing what was
computed, trimming, release, a PD request's KV arriving -- and the L3 prefetcher for the prefetch
fields). Every other module reads them (``req.kv.kv_len``) and asks ``ReqCache`` for a change;
``tests/layout/test_req_kv_writers.py`` checks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hicache.hiradix.node import TreeNode
from serving.structs.req_parts import PrefetchSlot


@dataclass
class ReqKV:
    """What the cache holds for one request (see the module docstring: written by serving/cache only).

    Concurrency contract: the scheduler thread only (the request's owner), like ``Req``.
    """

    # L1 pages: pages[i] holds positions i*page_size .. (i+1)*page_size-1 of Req.fill_ids
    pages: list[int] = field(default_factory=list)
    tree_pages: int = 0  # leading pages owned by the tree (the locked matched prefix)
    kv_len: int = 0  # tokens of fill_ids whose KV is in pages
    lock_node: TreeNode | None = None  # tree node locked for this request (None: nothing locked)
    load_node: TreeNode | None = None  # end of an L2 -> L1 load-back chain still to be committed
    wait_loads: tuple = ()  # PendingLoads still filling pages this request reads (see ReqCache.poll_load)
    # L3 prefetch while it waits
    prefetch: PrefetchSlot | None = None  # an L3 -> L2 prefetch in flight (its owner: serving/cache/l3_prefetch.py)
    prefetch_checked: bool = False  # its lookup was considered (once per wait)
    storage_hit_tokens: int = 0  # prompt tokens that came from L3 (through L2)
    l3_decision: dict[str, Any] | None = None  # the load-vs-recompute choice for its L3 pages, if any
    # reporting: what its first admission found cached
    cached_tokens: int = 0  # prompt tokens served from the cache
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # those tokens by tier: device / host / storage
    admitted: bool = False  # it was admitted once (its hits are counted then)
    # Recurrent state of a model with state layers (serving.cache.state_slots.RequestStates):
    state_slot: int = -1  # the request's working state slot in the L1 state pool (-1: none)
    snap_slot: int = -1  # its rolling capture: the state at the last page boundary a pass crossed (-1: none)
    snap_pos: int = -1  # the position (tokens of fill_ids) that capture is the state after (-1: none)
    captures: list[tuple[int, int]] = field(default_factory=list)  # fixed captures: (position, state slot)

    @property
    def own_pages(self) -> int:
        """Pages held by this request and not (yet) by the tree."""
        return len(self.pages) - self.tree_pages
