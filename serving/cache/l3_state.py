"""A state model's snapshots coming from L3 (serving/cache/l3_prefetch.py uses these on the scheduler thread).

A model with state layers resumes a prefix only at a state snapshot, so its L3 prefetch looks from the
deepest snapshot the tree can use without L3 (:func:`resume_point`); its lookup finds the deepest snapshot
L3 holds and starts its read (:func:`start_read`, on a lookup thread), and the snapshot joins the tree once
it and the pages before it are in (:func:`attach_when_in`, :func:`attach_fetched`). The rest: scheduler
thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from hicache.hiradix import HiRadixTree
from hicache.tiers.host_state import HostStatePool
from hicache.tiers.storage_state import StateStore
from serving.cache.prefetch_op import PrefetchOp


def resume_point(tree: HiRadixTree, prompt: list[int]) -> int:
    """Tokens of ``prompt`` a state model resumes from without L3: the end of the deepest whole node on
    its path with a snapshot on L1 or L2 (one the tree only knows as stored on L3 is fetched again)."""
    end = 0
    for nd, pos, m in tree.walk(prompt, len(prompt) - len(prompt) % tree.page_size):
        snap = nd.snap
        if m == len(nd.key) and snap is not None and (snap.device_slot is not None or snap.host_slot is not None):
            end = pos + m
    return end


def attach_fetched(tree: HiRadixTree, pool: HostStatePool, tokens: list[int], payload: bytes) -> int:
    """The snapshot after ``tokens`` (its verified L3 payload) into an L2 state slot and to the node
    ending there (``tree.state.attach_host``); 1 when the tree took it, 0 when refused (no such node on
    L2, no slot, one there already: the slot goes back)."""
    node = tree.node_at(tokens)
    slot = None if node is None else tree.state.alloc_host()
    if slot is None:
        return 0
    pool.load_slot_bytes(slot, payload)
    if tree.state.attach_host(node, slot) is not None:
        pool.free([slot])
        return 0
    return 1


def start_read(store: StateStore, keys: list[str], submit: Callable[..., Future]) -> tuple[int, Future] | None:
    """(A lookup thread.) ``(depth, read)``: the deepest of the stored pages ``keys`` whose snapshot L3 holds
    (existence only), and the read of the deepest good one there or above, submitted with ``submit``
    (``StateStore.find_deepest``: tens of MB read and verified while the pages before it are fetched); None:
    no snapshot, so no page is of use."""
    depth = store.deepest_stored(keys)
    return None if depth is None else (depth, submit(store.find_deepest, keys[:depth]))


def attach_when_in(tree: HiRadixTree, pool: HostStatePool, op: PrefetchOp, page_size: int) -> int:
    """Once ``op``'s snapshot read is done and the pages up to the snapshot it found are committed, the tree
    takes it (:func:`attach_fetched`) and ``op.state`` clears; 1 when taken. A read that found none good
    clears it too (the prefix resumes from the tree's own snapshot)."""
    got, f = op.state, op.fetch
    if got is None or f is None or not got[1].done():
        return 0
    found = got[1].result() if got[1].exception() is None else None
    if found is None:
        op.state = None
        return 0
    depth, payload = found
    if op.need < depth or f.committed < op.offset + depth:
        return 0
    op.state = None
    return attach_fetched(tree, pool, op.tokens[: (op.start_page + depth) * page_size], payload)
