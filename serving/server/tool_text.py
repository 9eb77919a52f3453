"""How tools and tool calls are written into a prompt, shared by Anthropic's tools
(serving/server/anthropic_tools.py) and OpenAI's (serving/server/openai_tools.py): a fixed
header and one tool a line as JSON (a text block before the system text), a call as
``<tool_call>\\n{"name", "arguments"}\\n</tool_call>``, a tool's answer as
``<tool_response>\\n...\\n</tool_response>`` (Hermes' spelling, as in Qwen2.5's template).
Pure functions; no imports from the server, so the request models can use them.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_HEAD = ("You can call these tools. Each line is one tool as JSON; to call one, answer with "
              "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.\n")


def tools_block(lines: list[str]) -> str:
    """The text block of the tools' JSON lines ('' without tools); the block of ``lines[:k]``
    is a prefix of the block of ``lines`` (a breakpoint on tool k - 1 ends inside the whole)."""
    return TOOLS_HEAD + "\n".join(lines) if lines else ""


def before_system(head: str, system: str) -> str:
    """Tools first, then the system text (Anthropic's cache order)."""
    return f"{head}\n\n{system}" if head and system else head or system


def tool_call(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def tool_response(text: str) -> str:
    return f"<tool_response>\n{text}\n</tool_response>"
