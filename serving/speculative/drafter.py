"""NGRAM drafts of one request: a chain of up to ``k`` tokens that followed the request's current
suffix elsewhere.

Two sources, each keyed by the suffix's last ``w`` tokens for ``w`` in ``levels`` (longest first):
the request's own prompt and output (:class:`~serving.speculative.history.RequestHistory`) and
every sequence the HiRadixTree holds (:class:`~serving.speculative.ngram_index.TreeNgramIndex`).
Each occurrence found is compared further back, up to ``max_window`` tokens; the longest match
wins, the request's own text on a tie. Among the matches of that length a ranking
(``speculative_ngram_match_type``) picks the chain:

- ``BFS`` (SGLang's default): the most recent occurrence's continuation;
- ``PROB``: token by token, the continuation most of those occurrences agree on (a vote; the
  more recent wins a tie), so the chain is the one seen most often.
"""

from __future__ import annotations

from collections.abc import Callable

from serving.speculative.history import RequestHistory
from serving.speculative.ngram_index import TreeNgramIndex

Matches = list[tuple[int, list[int]]]


def levels_for(min_window: int, max_window: int) -> tuple[int, ...]:
    """Key lengths indexed: the shortest match allowed, and 4 and 8 in between (a long key finds a
    long match however many times its last tokens occur)."""
    return tuple(sorted({min_window, *(w for w in (4, 8) if min_window < w <= max_window)}, reverse=True))


def rank_bfs(matches: Matches) -> list[int]:
    return matches[0][1]


def rank_prob(matches: Matches) -> list[int]:
    alive = [cont for _, cont in matches]
    out: list[int] = []
    while True:
        votes: dict[int, int] = {}
        for cont in alive:
            if len(cont) > len(out):
                tok = cont[len(out)]
                votes[tok] = votes.get(tok, 0) + 1
        if not votes:
            return out
        best = max(votes.values())
        tok = next(c[len(out)] for c in alive if len(c) > len(out) and votes[c[len(out)]] == best)
        out.append(tok)
        alive = [c for c in alive if len(c) >= len(out) and c[len(out) - 1] == tok]


RANKINGS: dict[str, Callable[[Matches], list[int]]] = {"BFS": rank_bfs, "PROB": rank_prob}


class NgramDrafter:
    def __init__(self, index: TreeNgramIndex | None, min_window: int, max_window: int, match_type: str) -> None:
        self.index = index
        self.min_window = min_window
        self.max_window = max_window
        self.levels = levels_for(min_window, max_window)
        self.rank = RANKINGS[match_type]

    def new_history(self) -> RequestHistory:
        return RequestHistory(self.levels)

    def draft(self, seq: list[int], history: RequestHistory, part: tuple[int, ...], k: int) -> tuple[list[int], int]:
        """(up to ``k`` drafts to follow ``seq``, the match's length): ``seq`` is the request's raw
        ids (``history`` indexes them and is brought up to date here), ``part`` its cache partition."""
        history.update(seq)
        local = history.find(seq, self.max_window, k)
        tree = self.index.find(part, seq, self.max_window, k) if self.index is not None else []
        best = max((n for n, _ in local + tree), default=0)
        if best < self.min_window:
            return [], 0
        matches = [m for m in local + tree if m[0] == best and m[1]]
        return (self.rank(matches)[:k], best) if matches else ([], 0)
