"""Turn last-token logits into next tokens, per request parameters."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serving.structs.sampling_params import SamplingParams


class Sampler:
    """Greedy rows go through one batched argmax; other rows are sampled one by one
    with their own generator (so a ``seed`` gives the same tokens whatever the batch).
    """

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, rid: str) -> None:
        self._generators.pop(rid, None)

    def sample(
        self,
        logits: torch.Tensor,  # [B, vocab] float32
        params: Sequence[SamplingParams],
        rids: Sequence[str],
        histories: Sequence[tuple[Sequence[int], Sequence[int]]],  # (prompt ids, output ids) per row
    ) -> list[int]:
        return self.choose(self.penalize(logits, params, histories), params, rids)

    def penalize(
        self,
        logits: torch.Tensor,  # [B, vocab]
        params: Sequence[SamplingParams],
        histories: Sequence[tuple[Sequence[int], Sequence[int]]],
    ) -> torch.Tensor:
        """The logits tokens are chosen from (float32, penalties applied; in place when they
        already are float32): what serving.runner.logprobs computes logprobs from."""
        logits = logits.float()
        for i, p in enumerate(params):
            if p.needs_penalties:
                self._apply_penalties(logits[i], p, *histories[i])
        return logits

    def choose(self, logits: torch.Tensor, params: Sequence[SamplingParams], rids: Sequence[str]) -> list[int]:
        """Next tokens from penalized logits (temperature, top-k/p, min-p, seeds applied here)."""
        out = torch.argmax(logits, dim=-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                out[i] = self._sample_row(logits[i], p, rids[i])
        return out

    @staticmethod
    def _apply_penalties(row: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: Sequence[int]) -> None:
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=row.device)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if output and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            ids = torch.tensor(output, dtype=torch.long, device=row.device)
            counts = torch.bincount(ids, minlength=row.numel())[: row.numel()].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def generator(self, rid: str, p: SamplingParams, device: torch.device) -> torch.Generator | None:
        """The request's own generator (None: unseeded, the global one); kept until ``forget``."""
        if p.seed is None:
            return None
        g = self._generators.get(rid)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(p.seed)
            self._generators[rid] = g
        return g

    def _sample_row(self, row: torch.Tensor, p: SamplingParams, rid: str) -> int:
        probs = self.probs(row, p)
        return int(torch.multinomial(probs, 1, generator=self.generator(rid, p, row.device)).item())

    @staticmethod
    def probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """The distribution a non-greedy row is sampled from (temperature, top-k, min-p, top-p
        applied to penalized logits): what speculative rejection sampling accepts drafts against."""
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            drop = (cum - sorted_p) > p.top_p  # keep the smallest set reaching top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        return probs / probs.sum()
