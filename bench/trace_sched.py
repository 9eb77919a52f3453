"""The server's pass loop in the policy replay: which requests each forward pass admits, chunks and
ends, with the clients of a closed-loop replay sending the next request as one ends.

A server does not run its requests in flight each at its own pace: every pass computes at most
``chunked_prefill_size`` prompt tokens, and the order the waiting requests are admitted in
(``schedule_policy``: ``lpm`` by their cached prefix) decides which prefixes are still on L1 when a
request is admitted. :class:`PassLoop` follows serving/scheduler/prefill.py's ``PrefillPlanner``
pass by pass, with no clock (a pass is a step; the L3 model is instant):

1. decode rows (requests past their prompt, one token each) reserve their page first; one that
   finds no room retracts the youngest other request (``Scheduler.retract``: its computed pages go
   into the tree, it goes back to the front of the queue);
2. while a request is partly prefilled, the waiting requests whose uncached prompt fits, together,
   in half the budget (the first ``BESIDE_SCAN`` in the policy's order) get that room first;
3. partly prefilled requests continue with the rest, each retracting younger ones still
   prefilling while its chunk finds no pages;
4. new requests, in the policy's order, take what is left: ``PolicyReplay.admit`` (match, load
   back, lock, reserve the first chunk); the first that finds no room stops admission.

A request whose prompt is complete has its first output token from that pass and ends once it has
``len(output)`` tokens; ending, its computed pages go into the tree (``PolicyReplay.release``) and
its client sends the next request of the slice, queued after the next pass is planned (a busy server
has started it by then; with ``overlap_schedule`` the ended requests are answered one pass late too, but
their pages go back as their last pass is launched: ``OverlapScheduler.release_ended``, every replayed
request ending by length).
A request whose prompt and output need more pages than L1 has is rejected as it arrives, counted.
With ``concurrency`` 1 the passes serve one request at a time, in trace order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence

from bench.trace_policy import PolicyReplay, SimReq
from serving.scheduler.prefill import BESIDE_SCAN
from serving.scheduler.schedule_policy import make_schedule_policy

NO_LIMIT = 1 << 62


class PassLoop:
    """Runs a slice through ``rep`` (see the module docstring). One use: :meth:`run`. ``after_pass``:
    called after each pass with the loop and the prompt tokens the pass computed (a test's check)."""

    def __init__(self, rep: PolicyReplay, after_pass: Callable[[PassLoop, int], None] | None = None) -> None:
        self.rep = rep
        self.after_pass = after_pass
        cfg = rep.cfg
        self.budget = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else NO_LIMIT
        self.policy = make_schedule_policy(cfg.schedule_policy)
        self.max_running = cfg.max_running_requests
        self.overlap = cfg.overlap_schedule
        self.waiting: list[SimReq] = []
        self.running: list[SimReq] = []
        self.unanswered: list[SimReq] = []  # overlap: ended (released) in the last pass, answered after this one
        self.passes = 0

    def run(self, reqs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> list[SimReq]:
        """Replay ``(prompt, output)`` pairs (``output``: the tokens each generates, at least one);
        returns the requests in slice order, each with its ``by_tier`` (None: rejected)."""
        todo = deque(SimReq(i, list(p), list(o) or [0]) for i, (p, o) in enumerate(reqs))
        done: list[SimReq] = []
        l1_pages = self.rep.cfg.l1_tokens // self.rep.cfg.page_size

        def arrive(r: SimReq) -> None:  # a prompt L1 cannot hold is refused (its client sends the next)
            while -(-(len(r.prompt) + len(r.output)) // self.rep.cfg.page_size) > l1_pages:
                self.rep.reject(r)
                done.append(r)
                if not todo:
                    return
                r = todo.popleft()
            self.waiting.append(r)

        for _ in range(min(self.rep.cfg.concurrency, len(todo))):
            arrive(todo.popleft())
        arriving: list[SimReq] = []  # sent by clients whose request was answered after the last pass
        while self.waiting or self.running or arriving or self.unanswered:
            idle = not self.running
            if idle:  # an idle server resolves what it has and takes new requests before its next pass
                for r in arriving:
                    arrive(r)
                arriving = []
            ended = self._pass() if self.waiting or self.running else []
            for r in ended:  # their pages go back as the pass is launched (overlap: before the answer)
                self.rep.release(r)
            if self.overlap and not idle:
                answered, self.unanswered = self.unanswered, ended
            else:
                answered, self.unanswered = self.unanswered + ended, []
            for r in arriving:
                arrive(r)
            arriving = []
            for r in answered:
                done.append(r)
                if todo:
                    arriving.append(todo.popleft())
        return sorted(done, key=lambda r: r.index)

    # -- one pass ------------------------------------------------------------------------
    def _pass(self) -> list[SimReq]:
        """One forward pass; returns the requests it ended (in running order), not yet released."""
        self.passes += 1
        rep = self.rep
        decode = [r for r in self.running if not r.prefilling]
        for r in decode:
            if r in self.running:
                self._reserve(r, 1, any_younger=True)
        decode = [r for r in decode if r in self.running and len(r.pages) * rep.cfg.page_size > r.filled]
        going = [r for r in self.running if r.prefilling]
        order = self.policy.order(list(self.waiting), rep.admission_key) if self.waiting else []
        beside, held = self._beside(order) if going else ([], 0)
        room = self.budget - held
        chunks: list[tuple[SimReq, int]] = []
        for r in going:
            if r not in self.running:  # retracted for an older one
                continue
            n = min(len(r.prompt) - r.filled, room)
            if n <= 0 or not self._reserve(r, n, any_younger=False):
                continue
            chunks.append((r, n))
            room -= n
        picked = {id(r) for r in beside}
        rest = [r for r in order if id(r) not in picked] if room > 0 else []
        chunks += self._admit(beside + rest, room + held)
        if not chunks and not decode:
            return self._stuck()
        for r, n in chunks:
            r.filled += n
            if not r.prefilling:
                r.out_done = 1  # the pass that ends the prompt gives the first output token
        for r in decode:
            r.filled += 1
            r.out_done += 1
        if self.after_pass is not None:
            self.after_pass(self, sum(n for _, n in chunks))
        ended = [r for r in self.running if r.out_done >= len(r.output)]
        for r in ended:
            self.running.remove(r)
        return ended

    def check_integrity(self) -> None:
        """The tree and its pools, the pages requests hold outside the tree counted as in use."""
        held = sum(len(r.pages) - r.prefix_pages for r in self.running)
        self.rep.tree.check_integrity(device_in_use=held)

    def _beside(self, order: list[SimReq]) -> tuple[list[SimReq], int]:
        share = self.budget // 2
        slots = self.max_running - len(self.running)
        picked: list[SimReq] = []
        held = 0
        for r in order[:BESIDE_SCAN]:
            if len(picked) >= slots or held >= share:
                break
            need = self.rep.uncached_len(r)
            if held + need <= share:
                picked.append(r)
                held += need
        return picked, held

    def _admit(self, order: list[SimReq], budget: int) -> list[tuple[SimReq, int]]:
        chunks = []
        for r in order:
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            n = self.rep.admit(r, budget)
            if n is None:
                break
            self.waiting.remove(r)
            self.running.append(r)
            chunks.append((r, n))
            budget -= n
        return chunks

    def _reserve(self, r: SimReq, n: int, any_younger: bool) -> bool:
        """Pages for ``n`` more tokens of ``r``, retracting younger requests (decode: any; a chunk:
        those still prefilling) youngest first while there is no room."""
        while not self.rep.reserve(r, r.filled + n):
            younger = [v for v in self.running[self.running.index(r) + 1:] if any_younger or v.prefilling]
            if any_younger and not younger:
                younger = [v for v in self.running if v is not r]
            if not younger:
                return False
            self._retract(younger[-1])
        return True

    def _retract(self, r: SimReq) -> None:
        self.running.remove(r)
        self.rep.release(r)
        self.rep.counts.retractions += 1
        self.waiting.insert(0, r)

    def _stuck(self) -> list[SimReq]:
        """A pass that ran nothing: fine while requests that ended wait to be answered (overlap);
        else the loop is broken (a request that fits L1 alone always progresses)."""
        if self.unanswered:
            return []
        raise RuntimeError(f"a pass ran nothing: {len(self.running)} running, {len(self.waiting)} waiting")
