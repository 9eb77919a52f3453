"""Output text of a request: incremental while streaming, exact when finished.

The finished text is what the offline Engine returns (full decode, cut at a matched stop
string). While streaming, text that could be the start of a stop string is held back, so a
stream never shows a stop string that the final text would cut.
"""

from __future__ import annotations

from typing import Any

from serving.server.req_handle import ReqState
from serving.tokenizer import IncrementalDetokenizer, Tokenizer


def final_text(
    tokenizer: Tokenizer | None,
    output_ids: list[int],
    finish_reason: dict[str, Any] | None,
    skip_special_tokens: bool = True,
) -> str:
    if tokenizer is None:
        return ""
    text = tokenizer.decode(output_ids, skip_special_tokens)
    reason = finish_reason or {}
    if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
        cut = text.find(reason["matched"])
        if cut >= 0:
            text = text[:cut]
    return text


class TextStream:
    """Feed it a request's state after each update; ``update`` returns the text to add."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        stop: list[str] | tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer else None
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # emitted so far

    def update(self, state: ReqState) -> str:
        if self.detok is None:
            return ""
        if state.finished:
            final = final_text(self.tok, state.output_ids, state.finish_reason, self.skip)
            delta = final[len(self.text) :] if final.startswith(self.text) else ""
        else:
            self.detok.update(state.output_ids)
            full = self.detok.text
            upto = max(len(self.text), len(full) - self.hold)
            delta = full[len(self.text) : upto]
        self.text += delta
        return delta
