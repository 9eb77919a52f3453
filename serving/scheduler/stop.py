"""When a request stops: EOS, stop tokens, stop strings, length limits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from serving.structs.request import Req


class StopChecker:
    """Decides a request's finish reason after each new token (SGLang's shapes:
    ``{"type": "stop", "matched": token_or_str}`` / ``{"type": "length", "length": n}``)."""

    def __init__(self, eos_token_ids: Sequence[int], decode: Callable[[list[int]], str] | None) -> None:
        self.eos = frozenset(eos_token_ids)
        self.decode = decode

    def check(self, r: Req, context_len: int) -> dict[str, Any] | None:
        p = r.sampling
        tok = r.output_ids[-1]
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos):
            return {"type": "stop", "matched": tok}
        if p.stop and self.decode is not None:
            matched = self._stop_string(r)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        if len(r.output_ids) >= p.max_new_tokens or r.seq_len >= context_len:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    @staticmethod
    def ends_by_length(r: Req, context_len: int) -> bool:
        """Whether ``r``'s pending token (overlap scheduling) ends it by length, whatever it is:
        then ``r`` needs no decode after it (its KV would never be read)."""
        return r.pending >= 0 and (len(r.output_ids) + 1 >= r.sampling.max_new_tokens or r.seq_len >= context_len)

    def _stop_string(self, r: Req) -> str | None:
        # Decode a tail long enough to contain any stop string plus a token boundary.
        longest = max(len(s) for s in r.sampling.stop)
        tail = self.decode(r.output_ids[-(longest + 8):])
        for s in r.sampling.stop:
            if s in tail:
                return s
        return None
