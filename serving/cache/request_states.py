"""The recurrent state of running requests of a model with state layers (linear attention, Mamba2).

Each admitted request holds three slots of the L1 state pool (``hicache/tiers/state_pool.py``):
- its **working slot** (``ReqKV.state_slot``): the state after its ``kv_len`` tokens, which every forward
  pass updates in place. At admission it is a copy of the tree's snapshot where its match ends
  (``MatchResult.state``: the match of a state model stops at the deepest snapshot), or zeros when
  nothing matched;
- its **capture slot** (``ReqKV.snap_slot``): each pass whose new tokens cross a page boundary copies the
  state at the last boundary crossed into it (``ForwardBatch.snap_slots`` / ``snap_offsets``;
  ``ReqKV.snap_pos`` says where). At release the request's full pages go into the tree and, when the
  capture is at their end, the capture goes to the node ending there (``HiRadixTree.attach_state``):
  where the next turn of the conversation resumes. A capture the tree refuses (that node already has
  one) goes back to the pool;
- its **prompt capture slot** (``ReqKV.prompt_snap_slot``): the state at the last page boundary before
  its prompt's last token, taken by the pass that crosses it instead of the other capture (one capture
  per sequence and pass); at release it goes to the node ending there: where the same prompt, asked
  again, resumes (a match always leaves the last prompt token to compute).

Snapshots are taken at page boundaries because the tree keeps whole pages; tokens past the last full
page are recomputed by the next request, as for any model.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.hiradix import HiRadixTree
from hicache.tiers.state_pool import DeviceStatePool
from serving.structs.request import Req


class RequestStates:
    """The state slots of running requests (see the module docstring).

    Concurrency contract: the scheduler thread only, as :class:`~serving.cache.req_cache.ReqCache`,
    which owns it. The tree's snapshots live in the same pool: the tree owns those slots, this class
    the requests' (``in_use`` counts them for ``check_integrity``). Slot copies are issued on the
    scheduler's stream, so a forward pass after :meth:`take` reads the copied state.
    """

    def __init__(self, tree: HiRadixTree, pool: DeviceStatePool, page_size: int) -> None:
        if tree.state is None:
            raise ValueError("a state pool needs a tree built with state_device (its snapshots)")
        self.tree = tree
        self.pool = pool
        self.page_size = page_size
        self.snapshots_attached = 0  # captures the tree took (reporting)

    SLOTS_PER_REQUEST = 3

    def take(self, req: Req, snapshot_slot: int | None) -> bool:
        """Give an admitted ``req`` its working and capture slots, the working one holding the tree's
        snapshot in L1 ``snapshot_slot`` (its match's; loaded already) or zeros (None). Makes room by
        evicting the tree's unlocked snapshots (demoted to L2 where they can be). False: no room now
        (nothing taken)."""
        kv = req.kv
        if kv.state_slot >= 0:
            return True
        n = self.SLOTS_PER_REQUEST
        if self.pool.num_free < n:
            self.tree.state.evict_device(n - self.pool.num_free)
        if self.pool.num_free < n:
            return False
        kv.state_slot, kv.snap_slot, kv.prompt_snap_slot = self.pool.alloc(n)
        kv.snap_pos = kv.prompt_snap_pos = -1
        if snapshot_slot is None:
            self.pool.zero_slot(kv.state_slot)
        else:
            self.pool.copy_slot(snapshot_slot, kv.state_slot)
        return True

    def plan(self, batch: Sequence[tuple[Req, int]]) -> tuple[list[int], list[int], list[int]]:
        """The forward pass's ``state_slots``, ``snap_slots``, ``snap_offsets`` for ``batch`` (each
        request with its number of new tokens from ``kv.kv_len`` on): a capture after the last page
        boundary a request's new tokens cross (``kv.snap_pos`` moves there), or the prompt capture
        when they cross its boundary (``kv.prompt_snap_pos``)."""
        slots, snaps, offsets = [], [], []
        page = self.page_size
        for req, n in batch:
            kv = req.kv
            start, end = kv.kv_len, kv.kv_len + n
            prompt_at = (len(req.input_ids) - 1) // page * page
            last = end // page * page
            slots.append(kv.state_slot)
            if kv.prompt_snap_slot >= 0 and start < prompt_at <= end:
                snaps.append(kv.prompt_snap_slot)
                offsets.append(prompt_at - start - 1)
                kv.prompt_snap_pos = prompt_at
            elif kv.snap_slot >= 0 and last > start:
                snaps.append(kv.snap_slot)
                offsets.append(last - start - 1)
                kv.snap_pos = last
            else:
                snaps.append(-1)
                offsets.append(-1)
        return slots, snaps, offsets

    def give_back(self, req: Req, inserted: Sequence[int]) -> None:
        """Release ``req``'s slots; ``inserted``: the tokens whose full pages it just put in the tree
        (their end node takes its capture when the capture is the state there)."""
        kv = req.kv
        if self._attach(kv.snap_slot, kv.snap_pos, inserted):
            kv.snap_slot = -1  # the tree's now
        if self._attach(kv.prompt_snap_slot, kv.prompt_snap_pos, inserted):
            kv.prompt_snap_slot = -1
        held = [s for s in (kv.state_slot, kv.snap_slot, kv.prompt_snap_slot) if s >= 0]
        if held:
            self.pool.free(held)
        kv.state_slot = kv.snap_slot = kv.prompt_snap_slot = kv.snap_pos = kv.prompt_snap_pos = -1

    def _attach(self, slot: int, pos: int, inserted: Sequence[int]) -> bool:
        """Hand the capture in ``slot`` (the state after ``pos`` tokens) to the node ending at ``pos``
        when the request's inserted pages reach it; True when the tree took it."""
        if slot < 0 or pos <= 0 or pos > len(inserted):
            return False
        node = self.tree.node_at(inserted[:pos])
        if node is None or self.tree.attach_state(node, slot) is not None:
            return False
        self.snapshots_attached += 1
        return True

    @staticmethod
    def in_use(reqs: Sequence[Req]) -> int:
        """Slots these requests hold (working and captures)."""
        return sum((r.kv.state_slot >= 0) + (r.kv.snap_slot >= 0) + (r.kv.prompt_snap_slot >= 0) for r in reqs)
