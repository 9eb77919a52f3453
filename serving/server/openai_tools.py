"""OpenAI tool definitions on /v1/chat/completions: ``tools`` (function definitions), assistant
``tool_calls`` and ``role: "tool"`` messages, rendered into the prompt as text the same way as
Anthropic's tools (serving/server/anthropic_tools.py): the tools are one JSON line each in a text
block before the system text, a call is ``<tool_call>{"name", "arguments"}</tool_call>`` in the
assistant's turn, a tool's answer a user turn ``<tool_response>...</tool_response>``. No tool call
is parsed out of the answer (``finish_reason`` is never ``tool_calls``); ``tool_choice`` may be
``none`` or ``auto``. Stateless: frozen pydantic values and pure functions.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from serving.server.tool_text import before_system, tool_call, tool_response, tools_block


class StrictModel(BaseModel):  # protocol.py's config (that module imports this one)
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDef(StrictModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: no constrained tool call is generated

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f'its "type" must be "object", got {v.get("type")!r}')
        return v


class FunctionTool(StrictModel):
    type: Literal["function"]
    function: FunctionDef

    def line(self) -> str:
        f = self.function
        d = {"name": f.name, **({"description": f.description} if f.description else {}),
             **({"parameters": f.parameters} if f.parameters is not None else {})}
        return json.dumps(d, ensure_ascii=False)


class CalledFunction(StrictModel):
    name: Annotated[str, Field(min_length=1)]
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def render(self) -> str:
        try:
            args: Any = json.loads(self.function.arguments)
        except ValueError:
            args = self.function.arguments  # kept as the text it is
        return tool_call(self.function.name, args)


def with_tools(tools: list[FunctionTool] | None, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The template messages with the tools' text block before the system text (a system
    message of its own when there is none)."""
    head = tools_block([t.line() for t in tools or []])
    if not head:
        return msgs
    if msgs and msgs[0]["role"] == "system":
        return [{"role": "system", "content": before_system(head, msgs[0]["content"])}, *msgs[1:]]
    return [{"role": "system", "content": head}, *msgs]


def message_text(role: str, content: str, tool_calls: list[ToolCall] | None, tool_call_id: str | None
                 ) -> dict[str, Any]:
    """One chat message as the template sees it; a ValueError ("field: ...") for a tool field on
    the wrong role."""
    if tool_calls and role != "assistant":
        raise ValueError("tool_calls: only assistant messages carry them")
    if (role == "tool") != (tool_call_id is not None):
        raise ValueError("tool_call_id: a tool message needs one, and only a tool message has one")
    if role == "tool":
        return {"role": "user", "content": tool_response(content)}
    calls = "\n".join(c.render() for c in tool_calls or [])
    return {"role": role, "content": "\n".join(x for x in (content, calls) if x)}
