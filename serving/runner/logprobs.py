"""Log probabilities of prompt and generated tokens (SGLang's ``return_logprob`` family).

What is computed: ``log_softmax`` over the vocabulary of the logits the sampler uses -- after
repetition / frequency / presence penalties and a grammar's mask, before temperature, top-k,
top-p and min-p -- in float32. So a greedy request's token is always its top-1 logprob, and
``temperature`` does not change a logprob (as in SGLang's default and vLLM's ``raw_logprobs``).
Tokens a grammar forbids have -inf, sent as -9999.0 (JSON has no infinities).

Prompt (input) logprobs: the logprob of prompt token ``t`` needs the logits at position
``t - 1``, so a request asking for them from ``start`` must compute positions
``max(start, 1) - 1 ..`` itself: :meth:`LogprobState.cache_limit` caps its cache match there
(a cached prefix has KV but no logits). The first prompt token has no logprob (None).

Cheap when off: a request without ``return_logprob`` has ``Req.logprob = None``, and the
scheduler does nothing extra for a batch where no request has one.

One owner per part: the numbers, here (:class:`LogprobState`, engine side); a request's options
and SGLang's ``meta_info`` shape, ``serving.runner.logprob_meta`` (torch-free: the offline Engine
and the HTTP process both use it); the OpenAI shapes, ``serving.server.logprob_format``; across
a PD transfer, ``serving.disagg.logprob_handoff``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from serving.runner.logprob_meta import MAX_TOP_LOGPROBS
from serving.structs.logprob_options import LogprobOptions
from serving.structs.sampling_params import InvalidRequest

MAX_TOKEN_IDS = 256
NEG_INF = -9999.0

Pair = list  # [logprob | None, token_id]


@dataclass
class LogprobState:
    """One request's logprob options and what was computed so far (engine side)."""

    start: int  # first prompt position with an input logprob; len(prompt): none
    top: int = 0  # top_logprobs_num
    token_ids: tuple[int, ...] = ()  # token_ids_logprob
    prompt_len: int = 0
    input: list[Pair] = field(default_factory=list)
    input_top: list[list[Pair] | None] = field(default_factory=list)
    input_ids: list[list[Pair] | None] = field(default_factory=list)
    output: list[Pair] = field(default_factory=list)
    output_top: list[list[Pair]] = field(default_factory=list)
    output_ids: list[list[Pair]] = field(default_factory=list)
    sent_input: int = 0
    sent_output: int = 0

    @classmethod
    def from_request(cls, opts: LogprobOptions | None, prompt: list[int], vocab: int) -> LogprobState | None:
        """From what the request asks (GenerateReq.logprobs); None: not asked."""
        if opts is None:
            return None
        prompt_len = len(prompt)
        start = opts.start_len
        start = prompt_len if start is None or start == -1 else start
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= prompt_len:
            raise InvalidRequest(f"logprob_start_len must be -1 or in [0, {prompt_len}] (the prompt has "
                                 f"{prompt_len} tokens), got {start}")
        top = opts.top or 0
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        ids = opts.token_ids or ()
        if not isinstance(ids, list | tuple) or len(ids) > MAX_TOKEN_IDS or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"token_ids_logprob must be a list of at most {MAX_TOKEN_IDS} token ids in "
                                 f"[0, {vocab})")
        st = cls(start=start, top=top, token_ids=tuple(ids), prompt_len=prompt_len)
        if start == 0 and prompt_len > 0:  # the first prompt token has no logprob
            st._add_input([None, prompt[0]], None, None)
        return st

    # -- prompt positions ------------------------------------------------------------------
    @property
    def first_logit_pos(self) -> int:
        """The first position whose logits the prompt logprobs need."""
        return max(self.start, 1) - 1

    @property
    def prompt_done(self) -> bool:
        return self.start >= self.prompt_len or len(self.input) == self.prompt_len - self.start

    def cache_limit(self, page_size: int) -> int | None:
        """How many leading tokens may come from the cache (page-aligned); None: no limit."""
        if self.prompt_done:
            return None
        return self.first_logit_pos // page_size * page_size

    def positions(self, kv_len: int, n: int) -> range:
        """Positions of a chunk ``kv_len .. kv_len + n - 1`` whose logits the prompt needs
        (never the last prompt position: its logits are the first output token's)."""
        if self.prompt_done:
            return range(0)
        lo = max(kv_len, self.first_logit_pos + len(self.input) - (self.start == 0))
        return range(lo, min(kv_len + n, self.prompt_len - 1))

    # -- recording ---------------------------------------------------------------------------
    def _add_input(self, pair: Pair, top: list[Pair] | None, ids: list[Pair] | None) -> None:
        self.input.append(pair)
        if self.top:
            self.input_top.append(top)
        if self.token_ids:
            self.input_ids.append(ids)

    def record_input(self, logits: torch.Tensor, targets: list[int]) -> None:
        for pair, top, ids in _entries(logits, targets, self.top, self.token_ids):
            self._add_input(pair, top, ids)

    def _add_output(self, pair: Pair, top: list[Pair] | None, ids: list[Pair] | None) -> None:
        self.output.append(pair)
        if self.top:
            self.output_top.append(top)
        if self.token_ids:
            self.output_ids.append(ids)

    def record_output(self, logits: torch.Tensor, token: int, output_ids: list[int]) -> None:
        """``token`` sampled from ``logits``, to follow ``output_ids`` (the outputs so far)."""
        self.pad_forced(output_ids)
        [(pair, top, ids)] = _entries(logits[None], [token], self.top, self.token_ids)
        self._add_output(pair, top, ids)

    def pad_forced(self, output_ids: list[int]) -> None:
        """Tokens a grammar forced (jump-forward) were not sampled: under the grammar's mask they
        had probability 1, so logprob 0 (and every other token -inf)."""
        for tok in output_ids[len(self.output):]:
            self._add_output([0.0, tok], [[0.0, tok]] if self.top else None,
                             [[0.0 if t == tok else NEG_INF, t] for t in self.token_ids] if self.token_ids else None)

    def take_new(self, output_ids: list[int]) -> dict[str, Any] | None:
        """What was computed since the last call (TokenOut.logprobs); None when nothing."""
        self.pad_forced(output_ids)
        new: dict[str, Any] = {}
        if len(self.input) > self.sent_input and self.prompt_done:  # the prompt's, all at once
            new["input"] = self.input[self.sent_input:]
            if self.top:
                new["input_top"] = self.input_top[self.sent_input:]
            if self.token_ids:
                new["input_ids"] = self.input_ids[self.sent_input:]
            self.sent_input = len(self.input)
        if len(self.output) > self.sent_output:
            a = self.sent_output
            new["output"] = self.output[a:]
            if self.top:
                new["output_top"] = self.output_top[a:]
            if self.token_ids:
                new["output_ids"] = self.output_ids[a:]
            self.sent_output = len(self.output)
        return new or None


def _entries(logits: torch.Tensor, targets: list[int], top: int, token_ids: tuple[int, ...]
             ) -> list[tuple[Pair, list[Pair] | None, list[Pair] | None]]:
    lp = torch.log_softmax(logits.float(), dim=-1).clamp_(min=NEG_INF)
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
    tops: list[list[Pair] | None] = [None] * len(targets)
    if top:
        v, i = lp.topk(top, dim=-1)
        tops = [[[a, b] for a, b in zip(vr, ir, strict=True)] for vr, ir in zip(v.tolist(), i.tolist(), strict=True)]
    ids: list[list[Pair] | None] = [None] * len(targets)
    if token_ids:
        sel = lp[:, list(token_ids)].tolist()
        ids = [[[a, t] for a, t in zip(row, token_ids, strict=True)] for row in sel]
    return [([c, t], tp, ip) for c, t, tp, ip in zip(chosen, targets, tops, ids, strict=True)]


# -- the scheduler's hooks (no work for batches where no request asks) ------------------------
def plan_prompt_rows(batch: list[tuple[Any, int]]) -> list[tuple[LogprobState, list[int], list[int]]]:
    """For a batch of ``(req, new tokens)``: per request that needs prompt logits in this chunk,
    its state, the rows (token axis of the batch) and the target ids (the next prompt tokens)."""
    plan, offset = [], 0
    for r, n in batch:
        st = r.logprob
        if st is not None and not st.prompt_done:
            pos = st.positions(r.kv.kv_len, n)
            if len(pos):
                plan.append((st, [offset + p - r.kv.kv_len for p in pos], [r.input_ids[p + 1] for p in pos]))
        offset += n
    return plan


def record_prompt_rows(plan: list[tuple[LogprobState, list[int], list[int]]], logits: torch.Tensor,
                       batch_size: int) -> torch.Tensor:
    """Record the prompt logprobs from the extra rows; return the ``[B, vocab]`` last-token logits."""
    at = batch_size
    for st, rows, targets in plan:
        st.record_input(logits[at: at + len(rows)], targets)
        at += len(rows)
    return logits[:batch_size]


def record_outputs(reqs: list[Any], logits: torch.Tensor, tokens: list[int]) -> None:
    """Each sampled token's logprob, from the logits it was chosen from (penalized, masked)."""
    for i, r in enumerate(reqs):
        if r.logprob is not None:
            r.logprob.record_output(logits[i], tokens[i], r.output_ids)
