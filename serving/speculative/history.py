"""One request's own tokens as an n-gram source (prompt lookup): what it may repeat of its prompt
(the file being edited, the tool schema of earlier turns) and of its own output.

Per key length ``w`` of ``levels``: a run of ``w`` tokens -> the positions that follow its latest
``per_key`` occurrences. Grown incrementally as the request's tokens are appended, at most
``chunk`` tokens per step (a long prompt is indexed over its first steps, drafting from what is
indexed so far), and only over its last ``window`` tokens (bounded memory: the tree's index holds
older text). Owned by one request (``Req.spec``), used on the scheduler thread only.
"""

from __future__ import annotations


class RequestHistory:
    __slots__ = ("levels", "per_key", "window", "chunk", "_map", "_n")

    def __init__(self, levels: tuple[int, ...], per_key: int = 16, window: int = 32768, chunk: int = 4096) -> None:
        self.levels = tuple(sorted(set(levels), reverse=True))
        self.per_key = per_key
        self.window = window
        self.chunk = chunk
        self._map: dict[tuple, list[int]] = {}
        self._n = -1  # tokens of the sequence indexed so far (-1: none yet)

    def update(self, seq: list[int]) -> None:
        """Index up to ``chunk`` more tokens of ``seq`` (which only grows)."""
        if self._n < 0:
            self._n = max(0, len(seq) - self.window)
        end = min(len(seq), self._n + self.chunk)
        m, per_key = self._map, self.per_key
        for w in self.levels:
            for j in range(max(w - 1, self._n), end):
                key = (w, *seq[j - w + 1: j + 1])
                lst = m.get(key)
                if lst is None:
                    m[key] = [j + 1]
                    continue
                lst.append(j + 1)
                if len(lst) > per_key:
                    del lst[0]
        self._n = end

    def find(self, seq: list[int], max_window: int, k: int) -> list[tuple[int, list[int]]]:
        """``(match length, continuation)`` of the latest earlier occurrences of ``seq``'s longest
        indexed suffix (latest first; ``seq`` is the indexed sequence). The suffix is compared back
        to ``max_window`` tokens; a continuation has at most ``k`` tokens."""
        n = len(seq)
        for w in self.levels:
            if n < w:
                continue
            lst = self._map.get((w, *seq[-w:]))
            if not lst:
                continue
            out: list[tuple[int, list[int]]] = []
            for pos in reversed(lst):
                if pos >= n:  # the suffix itself
                    continue
                length = w
                limit = min(max_window, pos)
                while length < limit and seq[pos - 1 - length] == seq[n - 1 - length]:
                    length += 1
                out.append((length, seq[pos: pos + k]))
            if out:
                return out
        return []
