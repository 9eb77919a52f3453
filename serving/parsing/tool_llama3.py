"""``llama3``: Llama 3.1 / 3.2 JSON calls, ``{"name": ..., "parameters": {...}}`` (``arguments``
taken too), after ``<|python_tag|>`` or as the whole answer; several separated by ``;``. The calls
run to the end of the answer: from the first thing that is not a call on, the rest is text."""

from __future__ import annotations

import json

from serving.parsing.tool_base import Parsed, Structure, ToolCall, ToolParser, add_text, call_from, marker_tail

TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3Parser(ToolParser):
    names = ("llama3",)
    keeps_special_tokens = True
    separator = ";"

    def parse(self, text: str, final: bool = True) -> Parsed:
        items: list[str | ToolCall] = []
        i = text.find(TAG)
        if i >= 0:
            add_text(items, text[:i])
            start = i + len(TAG)
        elif text.lstrip().startswith("{") or (not final and not text.strip()):
            start = 0
        else:
            cut = len(text) if final else marker_tail(text, 0, (TAG,))
            add_text(items, text[:cut])
            return Parsed(items, cut)
        pos = start
        while True:
            j = pos
            while j < len(text) and text[j].isspace():
                j += 1
            if j >= len(text):
                if not final:
                    return Parsed(items, pos if pos > start else (i if i >= 0 else 0))
                if pos == start:  # a tag and nothing after it: text
                    add_text(items, text[i:])
                return Parsed(items, len(text))  # whitespace after the last call is dropped
            try:
                value, end = _DECODER.raw_decode(text, j)
            except ValueError:
                if not final and text[j] == "{":  # may still become a call
                    return Parsed(items, pos if pos > start else (i if i >= 0 else 0))
                return _rest_text(items, text, pos, start, i)
            call = call_from(value)
            if call is None:
                return _rest_text(items, text, pos, start, i)
            items.append(call)
            k = end
            while k < len(text) and text[k].isspace():
                k += 1
            if k < len(text) and text[k] == ";":
                k += 1
            pos = k

    def structure(self, name: str) -> Structure:
        return Structure(f'{{"name": "{name}", "parameters": ', "}", "{")


def _rest_text(items: list[str | ToolCall], text: str, pos: int, start: int, tag: int) -> Parsed:
    """Not a call at ``pos``: the rest is text (with the tag, when no call came before)."""
    if pos == start and tag >= 0:
        add_text(items, text[tag:])
    else:
        add_text(items, text[pos:])
    return Parsed(items, len(text))
