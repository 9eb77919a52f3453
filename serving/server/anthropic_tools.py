"""Anthropic tool use on /v1/messages: the ``tools`` list and the ``tool_use`` / ``tool_result``
content blocks, rendered into the prompt as text (serving/server/anthropic_api.py uses them).

- A tool is ``{"name", "description"?, "input_schema", "cache_control"?}`` (a client tool,
  ``"type": "custom"`` optional); ``input_schema`` must be a JSON Schema object (``"type":
  "object"``). Server tools (``bash_20250124``, ``web_search_...``) are a 400.
- The tools become a text block at the start of the system prompt, one JSON object a line in
  the request's order, before the system text: Anthropic caches tools, then system, then
  messages, so a ``cache_control`` on the last tool pins the prefix up to the end of the
  tools. The chat template's own ``tools=`` is not used: templates put the tools after the
  system text (Qwen2.5) or into the first user turn (Llama 3.1), where no breakpoint could end
  at them, and SmolLM2's has none.
- ``tool_use`` (assistant) and ``tool_result`` (user) blocks in the history are rendered as
  ``<tool_call>{"name", "arguments"}</tool_call>`` and ``<tool_response>...</tool_response>``
  (common/prompt_form.py, the one owner of how a body becomes the template's messages). Calls
  in the answer are parsed with ``--tool-call-parser`` (``tool_use`` blocks, ``stop_reason``
  ``tool_use``); ``tool_choice`` ``any`` / ``tool`` are forced (serving/server/chat_output.py).

Stateless: the models are frozen pydantic values, the functions pure.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from common.prompt_form import anthropic_tool_line, anthropic_tools_text, before_system, block_text
from serving.server.chat_output import ToolRequest, check_choice
from serving.server.protocol import StrictModel


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a breakpoint (serving/server/cache_control.py)
    citations: list[Any] | None = None

    def render(self) -> str:
        return block_text(self.model_dump())


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None

    def render(self) -> str:
        return block_text(self.model_dump())


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def render(self) -> str:
        return block_text(self.model_dump())


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Tool(StrictModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type") != "object":
            raise ValueError(f'its "type" must be "object", got {v.get("type")!r}')
        return v

    def line(self) -> str:
        return anthropic_tool_line(self.model_dump())


def tools_text(tools: list[Tool] | None) -> str:
    """The system text block the tools become ('' without tools); the text of ``tools[:k]`` is a
    prefix of the text of ``tools`` (a breakpoint on tool k - 1 ends inside the whole one)."""
    return anthropic_tools_text([t.model_dump() for t in tools or []])


def system_text(tools: list[Tool] | None, system: str) -> str:
    """Tools first, then the system text (Anthropic's cache order)."""
    return before_system(tools_text(tools), system)


def check_roles(role: str, blocks: list[Any], where: str) -> None:
    """tool_use blocks come from the assistant, tool_result blocks from the user (as Anthropic's)."""
    for i, b in enumerate(blocks):
        if isinstance(b, ToolUseBlock) and role != "assistant":
            raise ValueError(f"{where}.content[{i}]: tool_use blocks belong to assistant messages")
        if isinstance(b, ToolResultBlock) and role != "user":
            raise ValueError(f"{where}.content[{i}]: tool_result blocks belong to user messages")


_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


def anthropic_tool_request(tools: list[Tool] | None, choice: dict[str, Any] | None) -> ToolRequest:
    """``tool_choice`` (``auto`` / ``any`` / ``tool`` + ``name`` / ``none``) in OpenAI's terms; ValueError."""
    defs = [{"name": t.name, "description": t.description, "parameters": t.input_schema} for t in tools or []]
    choice = choice or {"type": "auto"}
    kind = _CHOICES.get(choice.get("type"))  # type: ignore[arg-type]
    extra = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    if kind is None or extra:
        raise ValueError('tool_choice: must be {"type": "auto" | "any" | "tool" | "none"} (a tool: with "name")')
    name = choice.get("name") if kind == "function" else None
    check_choice(defs, kind, name, "tool_choice")
    return ToolRequest(defs, kind, name, not choice.get("disable_parallel_tool_use", False))
