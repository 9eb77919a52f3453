"""A state model's snapshots coming from L3 (serving/cache/l3_prefetch.py uses these on the scheduler thread).

A model with state layers resumes a prefix only at a state snapshot, so its L3 prefetch looks from the
deepest snapshot the tree can use without L3 (:func:`resume_point`), and a snapshot read from L3 joins
the tree once the pages before it are there (:func:`attach_fetched`). Scheduler thread only.
"""

from __future__ import annotations

from hicache.hiradix import HiRadixTree
from hicache.tiers.host_state import HostStatePool


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
