"""Tools and thinking on Ollama's /api/chat (and ``think`` on /api/generate), in Ollama's shapes.

Requests: ``tools`` are OpenAI's function definitions (Ollama takes the same form); a message may
be ``role: "tool"`` (a tool's answer, with Ollama's ``tool_name``), an assistant message may carry
``tool_calls`` (``{"function": {"name", "arguments": {...}}}``, arguments as an object) and its
``thinking`` (accepted, not shown to the model again, as Ollama's templates drop it). Both render
as on the OpenAI route (common/prompt_form.py). Ollama has no ``tool_choice``: calls are parsed
(with the server's ``--tool-call-parser``) whenever tools are given, as ``auto`` does.

``think``: ``false`` renders the template with ``enable_thinking=False`` (Qwen3's switch) and
leaves the answer whole; ``true`` or absent leaves the template's default and, with the server's
``--reasoning-parser``, returns the reasoning as ``thinking``; ``"low"`` / ``"medium"`` /
``"high"`` (GPT-OSS's levels) are passed as ``reasoning_effort``.

Answers: ``message.thinking``, ``message.content`` and ``message.tool_calls`` (each call as
``{"function": {"index", "name", "arguments": {...}}}``); streamed, thinking and content come as
they are decided and each call once whole, in the answer's order. Stateless functions.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from serving.parsing.output import OutputParser, Piece
from serving.parsing.tool_base import ToolCall
from serving.server.chat_output import ToolRequest
from serving.server.openai_tools import FunctionTool
from serving.server.protocol import StrictModel

Think = bool | Literal["low", "medium", "high"] | None


class CalledFunction(StrictModel):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None  # Ollama numbers a message's calls


class OllamaToolCall(StrictModel):
    function: CalledFunction


def tool_request(tools: list[FunctionTool] | None) -> ToolRequest | None:
    """The request's tools as the parsers take them (``auto``: Ollama has no tool_choice)."""
    if not tools:
        return None
    return ToolRequest([t.function.model_dump() for t in tools])


def template_kwargs(think: Think) -> dict[str, Any]:
    """The chat template's variables ``think`` sets."""
    if think is False:
        return {"enable_thinking": False}
    if isinstance(think, str):
        return {"reasoning_effort": think}
    return {}


def separates_thinking(think: Think) -> bool:
    return think is not False


def _arguments(call: ToolCall) -> dict[str, Any] | str:
    try:
        args = json.loads(call.arguments) if call.arguments else {}
    except ValueError:
        return call.arguments
    return args if isinstance(args, dict) else call.arguments


def ollama_calls(calls: list[ToolCall], first: int = 0) -> list[dict[str, Any]]:
    return [{"function": {"index": first + i, "name": c.name, "arguments": _arguments(c)}}
            for i, c in enumerate(calls)]


def message(parser: OutputParser, text: str) -> dict[str, Any]:
    """A whole answer as Ollama's assistant ``message``."""
    if not parser.active:
        return {"role": "assistant", "content": text}
    out = parser.parse(text)
    msg: dict[str, Any] = {"role": "assistant", "content": out.content}
    if parser.reasoning is not None and out.reasoning:
        msg["thinking"] = out.reasoning
    if out.calls:
        msg["tool_calls"] = ollama_calls(out.calls)
    return msg


def message_deltas(pieces: list[Piece]) -> list[dict[str, Any]]:
    """A stream's new pieces as the ``message`` of one NDJSON line each."""
    out: list[dict[str, Any]] = []
    for p in pieces:
        if p.kind == "reasoning":
            out.append({"role": "assistant", "content": "", "thinking": p.text})
        elif p.kind == "content":
            out.append({"role": "assistant", "content": p.text})
        elif p.call is not None:
            out.append({"role": "assistant", "content": "", "tool_calls": ollama_calls([p.call], p.index)})
    return out
