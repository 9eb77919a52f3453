"""The scheduler's one hook for speculative decoding (``--speculative-algorithm NGRAM``).

Per step, on the scheduler thread (``Scheduler._step``):

1. :meth:`SpeculativeWorker.propose` (after the decode rows are reserved and the prefill chunks
   scheduled): each decode request's drafts (``Req.spec.drafts``): the policy's budget
   (serving.speculative.policy), the drafter's chain, cut to the request's remaining
   ``max_new_tokens`` and context, to what its grammar accepts (structured output; the mask of
   every position is filled then, before the forward pass), and to the L1 slots free now: drafts
   never evict a cached page nor preempt a request. The row then has ``1 + k`` new tokens: the
   last token and the drafts, at positions ``kv_len .. kv_len + k``.
2. :meth:`verify_rows`: the logit rows of every drafted position but the last (which is the row's
   last-token row), appended to ``ForwardBatch.logit_rows`` after the prompt-logprob rows.
3. :meth:`accept` (after the forward pass): the rows of each drafted request, penalized with the
   history each position has and masked by its grammar, go through the acceptance rule
   (serving.speculative.verify); the accepted drafts and the bonus token are appended one by one
   through the scheduler's ``append`` (stop strings, stop ids, EOS, ``max_new_tokens``, the
   grammar: a request stops on exactly the token plain decoding stops on, and what follows is
   dropped). ``kv_len`` counts the positions whose KV holds an appended token; the pages past the
   next position go back to the free list at once, so no rejected draft's slot stays referenced
   (a slot of a kept page past ``kv_len`` is overwritten by the next token before anyone reads it).
   A model with state layers (Gated DeltaNet, Mamba2) cannot drop a draft's tokens from a recurrent
   state: its verify pass writes the state after each drafted position into the state pool's scratch
   (``RequestStates.reserve_verify``: drafts are cut to the scratch left, as to the free pages), and
   before the accepted tokens are appended the state after the last accepted one becomes the
   request's working state (``RequestStates.settle_verify``), so the next step starts exactly there.

Overlap scheduling (CUDA) needs the last token on the host to draft, so a step in which any
running request may draft is synchronous (:meth:`speculating`); steps where every request's
drafting is off (auto-off) overlap as before.

Concurrency contract: everything here runs on the scheduler thread; the index is fed by the
tree's listener, called inside the tree operations that thread makes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from serving.cache.req_cache import ReqCache
from serving.config import SchedulerConfig
from serving.runner.sampler import Sampler
from serving.speculative.cost import StepCost
from serving.speculative.drafter import NgramDrafter
from serving.speculative.ngram_index import TreeNgramIndex
from serving.speculative.policy import DraftPolicy, SpecState
from serving.speculative.verify import accept_greedy, accept_sampled
from serving.structs.request import Req

# A draft's relative cost until measured (serving.speculative.cost), from bench/speculative.py (CPU:
# SmolLM2-135M fp32 / int4 at batch 1 on the 2-core machine; CUDA: the verify-step table)
TOKEN_COST = {"cpu": 0.25, "cuda": 0.02}
MISS_LIMIT = 8  # CUDA: steps without a match before a request's drafting turns off (its steps overlap again)
PROBE_MIN_MATCH = 4  # a request without recent verifications drafts from a match this long at least
INDEX_TOKENS_PER_STEP = 8192  # the tree's new sequences indexed per step at most (serving.speculative.ngram_index)
MAX_SESSIONS = 4096  # sessions whose last request's acceptance a new turn starts from


@dataclass
class SpecStats:
    verify_steps: int = 0  # request-steps that verified drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0  # drafts accepted (and appended)
    auto_off: int = 0  # times a request's drafting turned off


class SpeculativeWorker:
    """See the module doc. ``grammar``: the scheduler's GrammarRunner (None: no structured output)."""

    def __init__(self, config: SchedulerConfig, cache: ReqCache, sampler: Sampler, context_len: int,
                 device: torch.device, overlap: bool, grammar=None) -> None:  # noqa: ANN001 - GrammarRunner
        self.cache = cache
        self.sampler = sampler
        self.context_len = context_len
        self.page_size = cache.page_size
        rank = (lambda n: n.hit_count) if config.speculative_ngram_match_type == "PROB" else (lambda n: n.last_access)
        min_w, max_w = config.speculative_ngram_min_match_window_size, config.speculative_ngram_max_match_window_size
        self.drafter = NgramDrafter(None, min_w, max_w, config.speculative_ngram_match_type)
        self.index = TreeNgramIndex(cache.tree, self.drafter.levels, config.speculative_ngram_capacity,
                                    rank_child=rank)
        self.drafter.index = self.index
        self.policy = DraftPolicy(config.speculative_num_draft_tokens - 1, miss_limit=MISS_LIMIT if overlap else None)
        self.cost = StepCost(TOKEN_COST.get(device.type, 0.02))
        self._step: tuple[int, int] | None = None  # (decode rows, drafts) of the step being run
        self.grammar = grammar  # the scheduler's (drafts of a constrained request follow its grammar)
        self.stats = SpecStats()
        # session id -> its last request's recent verifications: the next turn starts from them (an
        # agent's tool calls repeat across turns), not from the prior
        self._sessions: OrderedDict[str, deque] = OrderedDict()
        self._mask: torch.Tensor | None = None

    # -- before the forward pass -------------------------------------------------------------
    def speculating(self, reqs: list[Req]) -> bool:
        """Whether any of ``reqs`` may draft in its next decode step (that step is then synchronous)."""
        return any(r.spec is None or r.spec.off_left == 0 for r in reqs)

    def propose(self, decode: list[Req], prefill: bool) -> None:
        """Set ``r.spec.drafts`` of each decode row's request (and reserve their slots);
        ``prefill``: the step also runs prefill chunks (its time says nothing of the drafts')."""
        drafted: list[Req] = []
        states = self.cache.states  # a model with state layers: drafts need verify scratch
        if states is not None:
            states.begin_verify()
        self.index.catch_up(INDEX_TOKENS_PER_STEP)
        probe = not prefill and self.cost.wants_plain(len(decode))  # a plain step to measure
        cost = self.cost.terms(len(decode))
        for r in decode:
            st = r.spec
            if st is None:
                st = r.spec = SpecState(self.drafter.new_history())
                if r.session_id is not None and r.session_id in self._sessions:
                    st.recent.extend(self._sessions[r.session_id])
            st.drafts = []
            if r.pending >= 0 or st.history is None or probe:
                continue
            off = st.auto_off
            k = min(self.policy.budget(st, cost), r.sampling.max_new_tokens - len(r.output_ids) - 1,
                    self.context_len - r.seq_len - 1)
            self.stats.auto_off += st.auto_off - off
            if k <= 0:
                continue
            drafts, matched = self.drafter.draft(r.input_ids + r.output_ids, st.history, r.salt_tags, k)
            if not st.recent and matched < PROBE_MIN_MATCH:  # a probe needs some evidence: a short match is not
                drafts = []
            if not drafts:
                off = st.auto_off
                self.policy.on_miss(st)
                self.stats.auto_off += st.auto_off - off
                continue
            if r.grammar is not None:
                drafts = [] if r.grammar.waiting else self._grammar_filter(r, drafts)
            drafts = drafts[: self._room(r)]
            if states is not None:
                drafts = drafts[: states.verify_room()]
            if drafts and self.cache.reserve(r, r.kv.kv_len + 1 + len(drafts)):
                st.drafts = drafts
                drafted.append(r)
                if states is not None:
                    states.reserve_verify(r, len(drafts))
        if self.grammar is not None and any(r.grammar is not None for r in drafted):
            self._fill_masks(drafted)
        self._step = None if prefill else (len(decode), sum(len(r.spec.drafts) for r in drafted))

    def observe(self, seconds: float) -> None:
        """The step :meth:`propose` prepared took ``seconds`` (the scheduler's wall time)."""
        if self._step is not None:
            self.cost.observe(*self._step, seconds)
            self._step = None

    def _room(self, r: Req) -> int:
        """Drafts that fit the request's pages and the free ones (no eviction, no preemption)."""
        free = len(r.kv.pages) + self.cache.allocator.num_free
        return max(0, free * self.page_size - r.kv.kv_len - 1)

    @staticmethod
    def _grammar_filter(r: Req, drafts: list[int]) -> list[int]:
        """The drafts the request's grammar accepts in a row (up to its termination)."""
        m = r.grammar.matcher
        n = 0
        for d in drafts:
            if not m.accept_token(d):
                break
            n += 1
            if m.is_terminated():
                break
        if n:
            m.rollback(n)
        return drafts[:n]

    def _fill_masks(self, drafted: list[Req]) -> None:
        """The grammar's mask of every verified position, at the row ``accept`` gives it."""
        backend = self.grammar.backend
        total = sum(len(r.spec.drafts) + 1 for r in drafted)
        if self._mask is None or self._mask.shape[0] < total:
            self._mask = backend.allocate_mask(max(total, 64))
        row = 0
        for r in drafted:
            drafts = r.spec.drafts
            if r.grammar is not None:
                m = r.grammar.matcher
                r.spec.mask_row = row
                for j in range(len(drafts) + 1):
                    backend.fill_masks([m], self._mask, [row + j])
                    if j < len(drafts):
                        m.accept_token(drafts[j])
                m.rollback(len(drafts))
            row += len(drafts) + 1

    @staticmethod
    def drafts(r: Req) -> list[int]:
        return r.spec.drafts if r.spec is not None else []

    def verify_rows(self, batch: list[tuple[Req, int]]) -> list[int]:
        """Token-axis rows whose logits the verification needs besides each row's last one."""
        rows, offset = [], 0
        for r, n in batch:
            if n > 1 and self.drafts(r):
                rows.extend(range(offset, offset + n - 1))
            offset += n
        return rows

    # -- after it ----------------------------------------------------------------------------
    def accept(self, items: list[tuple[Req, int, int]], logits: torch.Tensor,
               append: Callable[[Req, int], None]) -> list[Req]:
        """Verify the drafted rows and append what they accept. ``items``: ``(request, its
        last-token row, its first verify row)`` in ``logits``, in batch order."""
        idx: list[int] = []
        for r, last, first in items:
            idx.extend(range(first, first + len(r.spec.drafts)))
            idx.append(last)
        rows = logits[torch.tensor(idx, device=logits.device)].float()
        plan, base, masked = [], 0, []
        for r, _, _ in items:
            k = len(r.spec.drafts)
            p = r.sampling
            if p.needs_penalties:  # each position's history: the output so far and the drafts before it
                hist = [(r.input_ids, r.output_ids + r.spec.drafts[:j]) for j in range(k + 1)]
                rows[base: base + k + 1] = self.sampler.penalize(rows[base: base + k + 1], [p] * (k + 1), hist)
            if r.grammar is not None:
                assert r.spec.mask_row == base
                masked.extend(range(base, base + k + 1))
            plan.append((r, base, k))
            base += k + 1
        if masked:
            self.grammar.backend.apply_masks(rows, self._mask, masked)
        targets = torch.argmax(rows, dim=-1).tolist()
        updated: list[Req] = []
        for r, base, k in plan:
            st, p = r.spec, r.sampling
            if p.greedy:
                tokens = accept_greedy(st.drafts, targets[base: base + k + 1])
            else:
                probs = torch.stack([Sampler.probs(rows[base + j], p) for j in range(k + 1)])
                tokens = accept_sampled(st.drafts, probs, self.sampler.generator(r.rid, p, rows.device))
            self._append(r, tokens, rows[base: base + k + 1], append)
            updated.append(r)
        return updated

    def _append(self, r: Req, tokens: list[int], rows: torch.Tensor, append: Callable[[Req, int], None]) -> None:
        st = r.spec
        k, accepted = len(st.drafts), len(tokens) - 1
        if self.cache.states is not None:  # state layers: back to the state after the last accepted draft
            self.cache.states.settle_verify(r, accepted)
        n = 0  # a decode row (kv_len == seq_len - 1): positions seq_len - 1 .. + accepted now hold real tokens' KV
        for i, tok in enumerate(tokens):
            self.cache.advance(r, 1)  # position kv_len: the KV of the token before ``tok``
            if r.logprob is not None:
                r.logprob.record_output(rows[i], tok, r.output_ids)
            append(r, tok)
            n += 1
            if r.finished:
                break
        off = st.auto_off
        self.policy.on_verify(st, k, accepted)
        self.stats.auto_off += st.auto_off - off
        used = min(accepted, n)  # the drafts that made it into the output
        st.accepted -= accepted - used
        self.stats.verify_steps += 1
        self.stats.draft_tokens += k
        self.stats.accepted_tokens += used
        st.drafts = []
        if r.finished:
            st.history = None  # its memory goes now; the counters stay for meta_info
            return
        self.cache.trim(r, r.kv.kv_len + 1)  # rejected drafts' pages back to the free list
        if r.grammar is not None and self.grammar is not None:
            self.grammar.jump_forward(r, append)  # as after a plainly sampled token

    def forget(self, r: Req) -> None:
        """A request left (finished, aborted): drop its history (a session keeps its acceptance)."""
        if r.spec is None:
            return
        r.spec.drafts = []
        r.spec.history = None
        if r.session_id is not None and r.spec.recent:
            self._sessions[r.session_id] = deque(r.spec.recent, maxlen=r.spec.recent.maxlen)
            self._sessions.move_to_end(r.session_id)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)

    def stats_dict(self) -> dict[str, Any]:
        return {**asdict(self.stats), **self.index.stats(), **self.cost.snapshot()}
