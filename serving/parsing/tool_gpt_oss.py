"""``gpt-oss``: harmony calls, ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
{...}<|call|>`` (``<|constrain|>json`` optional). Harmony's framing around messages
(``<|start|>assistant``, ``<|channel|>final<|message|>``, ``<|end|>``, ``<|return|>``) is not text."""

from __future__ import annotations

import re

from serving.parsing.tool_base import (
    Parsed,
    Structure,
    ToolCall,
    ToolParser,
    call_from,
    delimited,
    loads_object,
    marker_tail,
)

BEGIN, END = "<|channel|>commentary to=functions.", "<|call|>"
FRAMING = ("<|start|>assistant", "<|channel|>final<|message|>", "<|end|>", "<|return|>")
_BODY = re.compile(r"^([\w.-]+)\s*(?:<\|constrain\|>\s*json)?\s*(?:json)?\s*<\|message\|>(.*)$", re.S)


def strip_framing(text: str, final: bool) -> str:
    for f in FRAMING:
        text = text.replace(f, "")
    return text if final else text[:marker_tail(text, 0, FRAMING)]


def _read(body: str) -> ToolCall | None:
    m = _BODY.match(body)
    return None if m is None else call_from({"name": m.group(1), "arguments": loads_object(m.group(2).strip())})


class GptOssParser(ToolParser):
    names = ("gpt-oss",)
    keeps_special_tokens = True
    separator = ""

    def parse(self, text: str, final: bool = True) -> Parsed:
        return delimited(strip_framing(text, final), final, BEGIN, END, _read)

    def structure(self, name: str) -> Structure:
        return Structure(f"{BEGIN}{name} <|constrain|>json<|message|>", END, BEGIN)
