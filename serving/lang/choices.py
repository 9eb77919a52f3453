"""How ``select`` picks a choice from its token logprobs (SGLang's ``choices_method`` names).

Each method gets, per choice, the logprobs of the choice's tokens after the program's text
(``cond``) and, when it asks for them, after no context (``uncond``: the choice alone, whose
first token has no logprob and counts 0), and returns one score per choice; the highest wins
(the first on ties).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ChoiceLogprobs:
    tokens: list[int]
    cond: list[float]  # logprob of each of the choice's tokens after the program's text
    uncond: list[float] | None = None  # the same tokens without context (first: 0)


@dataclass(frozen=True)
class ChoicesMethod:
    name: str
    score: Callable[[ChoiceLogprobs], float]
    needs_unconditional: bool = False
    rank: Callable[[list[ChoiceLogprobs]], int] | None = None  # picks itself (the scores are then reported only)

    def pick(self, lps: list[ChoiceLogprobs]) -> tuple[int, list[float]]:
        scores = [self.score(c) for c in lps]
        if self.rank is not None:
            return self.rank(lps), scores
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        return best, scores


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("-inf")


def _uncond_normalized(c: ChoiceLogprobs) -> float:
    assert c.uncond is not None
    return _mean([a - b for a, b in zip(c.cond, c.uncond, strict=True)])


def _greedy(lps: list[ChoiceLogprobs]) -> int:
    """Token by token, keep the choices whose token is the most likely at that position; a
    choice that has ended continues with its mean logprob (so a prefix of a longer choice
    competes with it on equal terms)."""
    width = max(len(c.cond) for c in lps)
    rows = [c.cond + [_mean(c.cond)] * (width - len(c.cond)) for c in lps]
    alive = list(range(len(lps)))
    for j in range(width):
        top = max(rows[i][j] for i in alive)
        alive = [i for i in alive if rows[i][j] == top]
        if len(alive) == 1:
            break
    return alive[0]


token_length_normalized = ChoicesMethod("token_length_normalized", lambda c: _mean(c.cond))
unconditional_likelihood_normalized = ChoicesMethod(
    "unconditional_likelihood_normalized", _uncond_normalized, needs_unconditional=True)
sum_logprob = ChoicesMethod("sum_logprob", lambda c: sum(c.cond))
greedy_token_selection = ChoicesMethod("greedy_token_selection", lambda c: _mean(c.cond), rank=_greedy)

METHODS = {m.name: m for m in (token_length_normalized, unconditional_likelihood_normalized, sum_logprob,
                               greedy_token_selection)}


def resolve(method: ChoicesMethod | str | None) -> ChoicesMethod:
    if method is None:
        return token_length_normalized
    if isinstance(method, ChoicesMethod):
        return method
    if method in METHODS:
        return METHODS[method]
    raise ValueError(f"unknown choices_method {method!r}; one of {', '.join(METHODS)}")
