"""``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (a JSON array after the
marker; the array ends the calls, text may follow). An array that is not a list of calls stays text."""

from __future__ import annotations

import json

from serving.parsing.tool_base import Parsed, Structure, ToolCall, ToolParser, add_text, call_from, marker_tail

BEGIN = "[TOOL_CALLS]"
_DECODER = json.JSONDecoder()


class MistralParser(ToolParser):
    names = ("mistral",)
    keeps_special_tokens = True
    separator = " "

    def parse(self, text: str, final: bool = True) -> Parsed:
        items: list[str | ToolCall] = []
        pos = 0
        while True:
            i = text.find(BEGIN, pos)
            if i < 0:
                cut = len(text) if final else marker_tail(text, pos, (BEGIN,))
                add_text(items, text[pos:cut])
                return Parsed(items, cut)
            j = i + len(BEGIN)
            while j < len(text) and text[j].isspace():
                j += 1
            try:
                value, end = _DECODER.raw_decode(text, j)
            except ValueError:
                if not final and _may_grow(text, j):
                    add_text(items, text[pos:i])
                    return Parsed(items, i)
                add_text(items, text[pos: j])  # the marker and what follows stay text
                pos = j
                continue
            calls = [call_from(v) for v in (value if isinstance(value, list) else [value])]
            if not calls or any(c is None for c in calls):
                add_text(items, text[pos:end])
            else:
                add_text(items, text[pos:i])
                items.extend(c for c in calls if c is not None)
            pos = end

    def structure(self, name: str) -> Structure:
        return Structure(f'{BEGIN} [{{"name": "{name}", "arguments": ', "}]", BEGIN)


def _may_grow(text: str, j: int) -> bool:
    """The text from ``j`` could still become a JSON array or object (it is empty or starts one)."""
    return j >= len(text) or text[j] in "[{"
