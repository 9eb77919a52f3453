"""OpenAI tool definitions on /v1/chat/completions: ``tools`` (function definitions), assistant
``tool_calls`` and ``role: "tool"`` messages, rendered into the prompt as text the same way as
Anthropic's tools (serving/server/anthropic_tools.py): the tools are one JSON line each in a text
block before the system text, a call is ``<tool_call>{"name", "arguments"}</tool_call>`` in the
assistant's turn, a tool's answer a user turn ``<tool_response>...</tool_response>``. Calls in the
answer are parsed with the server's ``--tool-call-parser`` (serving/server/chat_output.py);
``tool_choice``: ``auto``, ``none``, ``required`` or ``{"type": "function", "function": {"name"}}``.
Stateless: frozen pydantic values and pure functions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.prompt_form import openai_tool_call, openai_tool_line


class StrictModel(BaseModel):  # protocol.py's config (that module imports this one)
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDef(StrictModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: forced calls (tool_choice required / named) always validate

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
        return openai_tool_line(self.model_dump())


class CalledFunction(StrictModel):
    name: Annotated[str, Field(min_length=1)]
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def render(self) -> str:
        return openai_tool_call(self.model_dump())


def check_tool_fields(role: str, tool_calls: list[ToolCall] | None, tool_call_id: str | None) -> None:
    """A ValueError ("field: ...") for a tool field on the wrong role."""
    if tool_calls and role != "assistant":
        raise ValueError("tool_calls: only assistant messages carry them")
    if (role == "tool") != (tool_call_id is not None):
        raise ValueError("tool_call_id: a tool message needs one, and only a tool message has one")


def openai_tool_choice(choice: str | dict[str, Any] | None) -> tuple[str, str | None]:
    """``tool_choice`` -> (auto | none | required | function, the function's name); ValueError."""
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ValueError(f'tool_choice: must be "auto", "none", "required" or a function, got {choice!r}')
        return choice, None
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError('tool_choice: an object must be {"type": "function", "function": {"name": ...}}')
    return "function", fn["name"]
