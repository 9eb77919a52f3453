"""``qwen25`` (also ``qwen``, ``hermes``): Qwen2.5 / Qwen3 / Hermes, one call per
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, text around them kept."""

from __future__ import annotations

from serving.parsing.tool_base import Parsed, Structure, ToolCall, ToolParser, call_from, delimited, loads_object

BEGIN, END = "<tool_call>", "</tool_call>"


def _read(body: str) -> ToolCall | None:
    return call_from(loads_object(body.strip()))


class HermesParser(ToolParser):
    names = ("qwen25", "qwen", "hermes")

    def parse(self, text: str, final: bool = True) -> Parsed:
        return delimited(text, final, BEGIN, END, _read)

    def structure(self, name: str) -> Structure:
        return Structure(f'{BEGIN}\n{{"name": "{name}", "arguments": ', f"}}\n{END}", BEGIN)
