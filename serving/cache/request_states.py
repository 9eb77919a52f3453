"""The recurrent state of running requests of a model with state layers (linear attention, Mamba2).

Each admitted request holds slots of the L1 state pool (``hicache/tiers/state_pool.py``):
- its **working slot** (``ReqKV.state_slot``): the state after its ``kv_len`` tokens, which every forward
  pass updates in place. At admission it is a copy of the tree's snapshot where its match ends
  (``MatchResult.state``: the match of a state model stops at the deepest snapshot), or zeros when
  nothing matched;
- its **rolling capture** (``ReqKV.snap_slot``): each pass whose new tokens cross a page boundary copies
  the state at the last boundary crossed into it (``ForwardBatch.snap_slots`` / ``snap_offsets``;
  ``ReqKV.snap_pos`` says where). At release the request's full pages go into the tree and the capture,
  the state at their end, goes to the node ending there (``HiRadixTree.attach_state``): where the next
  turn of the conversation resumes;
- **fixed captures** (``ReqKV.captures``, each a position and a slot taken when its pass is planned,
  only while the pool has more than one admission's slots free: a capture is never worth a refused
  request) at the page boundaries where a later request may diverge: the last one before the prompt's
  last token (where the same prompt asked again resumes: a match always leaves that token to compute),
  the ends of the prompt's ``cache_control`` breakpoints (``Req.capture_at``: a shared system prompt or
  tool block), and the last one in each prefill chunk that does not end the prompt (a long document
  asked about again with another question resumes at the chunk before it differs). At most
  ``MAX_CAPTURES`` a request. A pass captures once per sequence, so a prefill chunk that would cross two
  of the prompt's positions ends at the first (:meth:`chunk`: one more pass, once); a pass crossing
  several anyway takes the deepest. At release each goes to the node ending at its position.

With speculative decoding a drafting request's verify pass (its last token and ``k`` drafts) takes
no capture; the pool's scratch (``DeviceStatePool.scratch_base``) gives it ``k`` slots for the step
(:meth:`reserve_verify`), into which the state layers write the state after each of its tokens but the
last (``ForwardBatch.set_state``'s ``SNAP_EVERY``), while the working slot ends after the last draft.
Once the drafts are judged, :meth:`settle_verify` copies the state after the last accepted one into
the working slot and, when the accepted tokens cross a page boundary, the state there into the rolling
capture: no rejected draft's token is ever in a state a request keeps or the tree gets.

A capture the tree refuses (that node has one already) goes back to the pool. Snapshots are taken at
page boundaries because the tree keeps whole pages; tokens past the last full page are recomputed by
the next request, as for any model.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.hiradix import HiRadixTree
from hicache.tiers.state_pool import DeviceStatePool
from serving.structs.forward_batch import SNAP_EVERY
from serving.structs.request import Req

MAX_CAPTURES = 8  # fixed captures a request keeps at most


class RequestStates:
    """The state slots of running requests (see the module docstring).

    Concurrency contract: the scheduler thread only, as :class:`~serving.cache.req_cache.ReqCache`,
    which owns it. The tree's snapshots live in the same pool: the tree owns those slots, this class
    the requests' (``in_use`` counts them for ``check_integrity``). Slot copies are issued on the
    scheduler's stream, so a forward pass after :meth:`take` reads the copied state.
    """

    SLOTS_PER_REQUEST = 2  # taken at admission: the working slot and the rolling capture

    def __init__(self, tree: HiRadixTree, pool: DeviceStatePool, page_size: int) -> None:
        if tree.state is None:
            raise ValueError("a state pool needs a tree built with state_device (its snapshots)")
        self.tree = tree
        self.pool = pool
        self.page_size = page_size
        self.snapshots_attached = 0  # captures the tree took (reporting)
        self._verify: dict[int, tuple[int, int]] = {}  # this step's verify rows: rid -> (first scratch slot, k)
        self._scratch_next = pool.scratch_base

    def take(self, req: Req, snapshot_slot: int | None) -> bool:
        """Give an admitted ``req`` its working slot and rolling capture, the working one holding the
        tree's snapshot in L1 ``snapshot_slot`` (its match's; loaded already) or zeros (None). Makes room
        by evicting the tree's unlocked snapshots (demoted to L2 where they can be). False: no room now
        (nothing taken)."""
        kv = req.kv
        if kv.state_slot >= 0:
            return True
        n = self.SLOTS_PER_REQUEST
        if self.pool.num_free < n:
            self.tree.state.evict_device(n - self.pool.num_free)
        if self.pool.num_free < n:
            return False
        kv.state_slot, kv.snap_slot = self.pool.alloc(n)
        kv.snap_pos = -1
        if snapshot_slot is None:
            self.pool.zero_slot(kv.state_slot)
        else:
            self.pool.copy_slot(snapshot_slot, kv.state_slot)
        return True

    def plan(self, batch: Sequence[tuple[Req, int]]) -> tuple[list[int], list[int], list[int]]:
        """The forward pass's ``state_slots``, ``snap_slots``, ``snap_offsets`` for ``batch`` (each
        request with its number of new tokens from ``kv.kv_len`` on): a fixed capture where the new
        tokens cross one of its positions, else the rolling one at the last page boundary crossed."""
        slots, snaps, offsets = [], [], []
        for req, n in batch:
            kv = req.kv
            start, end = kv.kv_len, kv.kv_len + n
            slots.append(kv.state_slot)
            verify = self._verify.get(req.rid) if n > 1 else None
            if verify is not None:  # a verify row: the state after each token but the last, to scratch
                assert n - 1 <= verify[1], (n, verify)
                snaps.append(verify[0])
                offsets.append(SNAP_EVERY)
                continue
            fixed = self._fixed_position(req, start, end)
            if fixed is not None and self._room_for_capture(kv):
                slot = self.pool.alloc(1)[0]
                kv.captures.append((fixed, slot))
                snaps.append(slot)
                offsets.append(fixed - start - 1)
                continue
            last = end // self.page_size * self.page_size
            if kv.snap_slot >= 0 and last > start:
                snaps.append(kv.snap_slot)
                offsets.append(last - start - 1)
                kv.snap_pos = last
            else:
                snaps.append(-1)
                offsets.append(-1)
        return slots, snaps, offsets

    # -- speculative verification (see the module docstring) -----------------------------------
    def begin_verify(self) -> None:
        """A step's drafts are about to be proposed: last step's scratch is free again."""
        self._verify.clear()
        self._scratch_next = self.pool.scratch_base

    def verify_room(self) -> int:
        """Drafts the scratch left this step can verify (for one request)."""
        return self.pool.scratch_base + self.pool.num_scratch - self._scratch_next

    def reserve_verify(self, req: Req, drafts: int) -> None:
        """``req`` verifies ``drafts`` drafts this step (at most :meth:`verify_room`): its scratch run."""
        if not 0 < drafts <= self.verify_room():
            raise ValueError(f"{drafts} drafts to verify, scratch for {self.verify_room()}")
        self._verify[req.rid] = (self._scratch_next, drafts)
        self._scratch_next += drafts

    def settle_verify(self, req: Req, accepted: int) -> None:
        """``req``'s verify pass ran and ``accepted`` of its drafts were accepted (before ``kv_len``
        advances past them): the working slot := the state after the last accepted one, and the
        rolling capture := the state at the last page boundary its accepted tokens crossed."""
        first, k = self._verify.pop(req.rid)
        if not 0 <= accepted <= k:
            raise ValueError(f"{accepted} drafts accepted of {k}")
        kv = req.kv
        start = kv.kv_len
        last = (start + accepted + 1) // self.page_size * self.page_size
        if kv.snap_slot >= 0 and last > start:
            j = last - start - 1  # the state of ``last`` tokens: after new token j (j <= accepted)
            self.pool.copy_slot(first + j if j < k else kv.state_slot, kv.snap_slot)
            kv.snap_pos = last
        if accepted < k:
            self.pool.copy_slot(first + accepted, kv.state_slot)

    def chunk(self, req: Req, n: int) -> int:
        """How many of the ``n`` prompt tokens after ``kv.kv_len`` this pass computes: up to the first
        of the prompt's fixed positions when it would cross two (each gets its capture)."""
        start = req.kv.kv_len
        hits = self._prompt_positions(req, start, start + n)
        return hits[0] - start if len(hits) >= 2 and len(req.kv.captures) < MAX_CAPTURES else n

    def _prompt_positions(self, req: Req, start: int, end: int) -> list[int]:
        """The prompt's fixed capture positions in ``(start, end]``, sorted: the last page boundary
        before its last token and its breakpoints' ends, floored to pages."""
        page, prompt = self.page_size, len(req.input_ids)
        if start >= prompt - 1:
            return []
        wanted = {(prompt - 1) // page * page, *(p // page * page for p in req.capture_at if p < prompt)}
        return sorted(p for p in wanted if start < p <= end and p > 0)

    def _fixed_position(self, req: Req, start: int, end: int) -> int | None:
        """The deepest fixed capture position in ``(start, end]`` (see the module docstring)."""
        prompt = len(req.input_ids)
        if start >= prompt - 1:
            return None  # decoding: only the rolling capture
        hits = self._prompt_positions(req, start, end)
        if end < prompt - 1 and end // self.page_size * self.page_size > start:  # a chunk short of the prompt's end
            hits.append(end // self.page_size * self.page_size)
        return max(hits) if hits else None

    def _room_for_capture(self, kv) -> bool:  # noqa: ANN001 (ReqKV)
        """A fixed capture takes a free slot only while another admission's would still be free."""
        return len(kv.captures) < MAX_CAPTURES and self.pool.num_free > self.SLOTS_PER_REQUEST + 1

    def give_back(self, req: Req, inserted: Sequence[int]) -> None:
        """Release ``req``'s slots; ``inserted``: the tokens whose full pages it just put in the tree
        (the nodes ending at its captures' positions take them)."""
        kv = req.kv
        held = [s for s in (kv.state_slot, kv.snap_slot) if s >= 0]
        if held and self._attach(kv.snap_slot, kv.snap_pos, inserted):
            held.remove(kv.snap_slot)
        for pos, slot in kv.captures:
            if not self._attach(slot, pos, inserted):
                held.append(slot)
        if held:
            self.pool.free(held)
        kv.state_slot = kv.snap_slot = kv.snap_pos = -1
        kv.captures = []

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
        """Slots these requests hold (working, rolling and fixed captures)."""
        return sum((r.kv.state_slot >= 0) + (r.kv.snap_slot >= 0) + len(r.kv.captures) for r in reqs)
