"""The offline Engine's streamed outputs (``Engine.generate(..., stream=True)``,
``Engine.async_generate(..., stream=True)``): one chunk per step that produced something.

Each chunk is shaped like a non-streamed answer but incremental: ``text`` and ``output_ids`` are
what is new since the previous chunk (their concatenation over the stream is the non-streamed
answer's ``text`` and ``output_ids``), ``meta_info`` is the request's so far (cumulative counts; the
last chunk's is the final one, ``finish_reason`` set). Text that could still turn out to be a stop
string's start, or an unfinished UTF-8 character, is held back until it is settled.
"""

from __future__ import annotations

from typing import Any

from serving.structs.request import Req

_PARTIAL = "\ufffd"  # what a decode of an unfinished multi-byte character ends with


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could still begin a stop string (or are an
    unfinished character)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    if text.endswith(_PARTIAL):
        hold = max(hold, len(text) - len(text.rstrip(_PARTIAL)))
    return hold


class StreamState:
    """What one streamed request has handed out so far.

    Concurrency contract: used by the thread (or coroutine) that iterates its stream only.
    """

    def __init__(self, req: Req) -> None:
        self.req = req
        self.sent_ids = 0
        self.sent_text = ""

    def chunk(self, out: dict[str, Any], decode: Any) -> dict[str, Any] | None:
        """The next chunk, from ``out`` (the request's answer so far: ``output_dict``); None when
        nothing new can be handed out yet. ``decode``: ids -> text (None without a tokenizer)."""
        r = self.req
        ids = list(r.output_ids)
        if r.finished:
            text = out["text"]  # cut at the stop string, as the non-streamed answer
        elif decode is None:
            text = ""
        else:
            full = decode(ids)
            text = full[: len(full) - _held_back(full, r.sampling.stop)]
        new_text = text[len(self.sent_text):] if text.startswith(self.sent_text) else ""
        new_ids = ids[self.sent_ids:]
        if not new_ids and not new_text and not r.finished:
            return None
        if text.startswith(self.sent_text):
            self.sent_text = text
        self.sent_ids = len(ids)
        return {**out, "text": new_text, "output_ids": new_ids}
