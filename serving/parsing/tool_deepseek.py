"""``deepseekv3``: DeepSeek-V3 / R1 calls, ``<｜tool▁calls▁begin｜>`` then each call as
``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``, then
``<｜tool▁calls▁end｜>``; the outer markers are dropped, a call that does not parse stays text."""

from __future__ import annotations

import json
import re

from serving.parsing.tool_base import Parsed, Structure, ToolCall, ToolParser, delimited, loads_object, marker_tail

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
BEGIN, SEP, END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_BODY = re.compile(r"^(?:function)?" + re.escape(SEP) + r"([^\n]+)\n```(?:json)?\n?(.*?)\n?```\s*$", re.S)


def _read(body: str) -> ToolCall | None:
    m = _BODY.match(body)
    if m is None:
        return None
    args = loads_object(m.group(2).strip())
    return ToolCall(m.group(1).strip(), _dumps(args)) if isinstance(args, dict) and m.group(1).strip() else None


def _dumps(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


class DeepSeekV3Parser(ToolParser):
    names = ("deepseekv3",)
    keeps_special_tokens = True
    separator = ""

    def parse(self, text: str, final: bool = True) -> Parsed:
        clean = text.replace(CALLS_BEGIN, "").replace(CALLS_END, "")  # the outer markers are not text
        if not final:  # nor the start of one
            clean = clean[:marker_tail(clean, 0, (CALLS_BEGIN, CALLS_END))]
        return delimited(clean, final, BEGIN, END, _read)

    def structure(self, name: str) -> Structure:
        return Structure(f"{BEGIN}function{SEP}{name}\n```json\n", f"\n```{END}", BEGIN)
