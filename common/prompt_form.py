"""A chat request's messages in the one form the chat template sees: the prompt normalisation of
every API face, as pure functions over the request body's plain values (JSON dicts, lists, str).

One owner for two readers: the worker's API faces (serving/server/: their pydantic models validate
a body, then hand their values here) and the router's routing key (router/routing_key.py, on the
raw body), so a request is keyed on exactly the token ids the worker prefills -- the prefix its KV
is cached under. Neither may import the other; both import this. Values the worker would refuse
(a 400) are rendered as best they can be, never raised on: the router routes those anywhere.

The forms:
- OpenAI chat (``openai_chat``): ``developer`` is ``system``; content parts are joined by their
  text; an assistant's ``tool_calls`` follow its text as ``<tool_call>`` lines; a ``tool``
  message is a user turn ``<tool_response>...</tool_response>``; ``tools`` are a text block before
  the system text.
- Anthropic (``anthropic_chat``): the tools' block, then ``system`` (a string or text blocks),
  then the messages; ``tool_use`` / ``tool_result`` blocks as ``<tool_call>`` /
  ``<tool_response>`` (Anthropic caches tools, then system, then messages: a breakpoint on the
  last tool ends where the tools' block ends).
- Ollama (``ollama_chat``, ``ollama_generate``): chat as OpenAI's (Ollama's tools, tool messages
  and calls take its forms); a non-raw generate is ``system`` then the prompt as the user's message.

Tools are written as text, one JSON object a line after a fixed header (the chat template's own
``tools=`` puts them where no breakpoint could end at them, and SmolLM2's template has none);
calls and answers in the Hermes / Qwen2.5 spelling.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_HEAD = ("You can call these tools. Each line is one tool as JSON; to call one, answer with "
              "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.\n")
Message = dict[str, Any]


def tools_block(lines: list[str]) -> str:
    """The text block of the tools' JSON lines ('' without tools); the block of ``lines[:k]``
    is a prefix of the block of ``lines`` (a breakpoint on tool k - 1 ends inside the whole)."""
    return TOOLS_HEAD + "\n".join(lines) if lines else ""


def before_system(head: str, system: str) -> str:
    """Tools first, then the system text (Anthropic's cache order)."""
    return f"{head}\n\n{system}" if head and system else head or system


def tool_call(name: Any, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def tool_response(text: str) -> str:
    return f"<tool_response>\n{text}\n</tool_response>"


def _dicts(xs: Any) -> list[dict[str, Any]]:
    return [x for x in xs if isinstance(x, dict)] if isinstance(xs, list) else []


def _str(x: Any) -> str:
    return x if isinstance(x, str) else ""


def block_text(block: dict[str, Any]) -> str:
    """One content part / block: text as it is, Anthropic's ``tool_use`` and ``tool_result``
    as a call and an answer; any other part adds nothing."""
    kind = block.get("type")
    if kind == "tool_use":
        return tool_call(block.get("name"), block.get("input"))
    if kind == "tool_result":
        return tool_response(("Error: " if block.get("is_error") else "") + content_text(block.get("content")))
    return _str(block.get("text"))


def content_text(content: Any) -> str:
    """A message's content: a string, or the text of its parts / blocks joined."""
    if isinstance(content, str):
        return content
    return "".join(block_text(b) for b in _dicts(content))


def _with_head(head: str, msgs: list[Message]) -> list[Message]:
    """The tools' block before the system text (a system message of its own when there is none)."""
    if not head:
        return msgs
    if msgs and msgs[0]["role"] == "system":
        return [{"role": "system", "content": before_system(head, msgs[0]["content"])}, *msgs[1:]]
    return [{"role": "system", "content": head}, *msgs]


# ------------------------------------------------------------------------------- OpenAI chat
def openai_tool_line(tool: dict[str, Any]) -> str:
    f = tool.get("function") if isinstance(tool.get("function"), dict) else {}
    d = {"name": f.get("name"), **({"description": f["description"]} if f.get("description") else {}),
         **({"parameters": f["parameters"]} if f.get("parameters") is not None else {})}
    return json.dumps(d, ensure_ascii=False)


def openai_tool_call(call: dict[str, Any]) -> str:
    f = call.get("function") if isinstance(call.get("function"), dict) else {}
    args: Any = f.get("arguments")
    try:
        args = json.loads(args)
    except (TypeError, ValueError):
        pass  # kept as the text it is
    return tool_call(f.get("name"), args)


def openai_message(m: dict[str, Any]) -> Message:
    role = "system" if m.get("role") == "developer" else m.get("role")
    content = content_text(m.get("content"))
    if role == "tool":
        return {"role": "user", "content": tool_response(content)}
    calls = "\n".join(openai_tool_call(c) for c in _dicts(m.get("tool_calls")))
    return {"role": role, "content": "\n".join(x for x in (content, calls) if x)}


def openai_chat(messages: Any, tools: Any = None) -> list[Message]:
    """/v1/chat/completions' ``messages`` and ``tools`` as the template sees them."""
    head = tools_block([openai_tool_line(t) for t in _dicts(tools)])
    return _with_head(head, [openai_message(m) for m in _dicts(messages)])


# ------------------------------------------------------------------------------- Anthropic
def anthropic_tool_line(tool: dict[str, Any]) -> str:
    d = {"name": tool.get("name"), **({"description": tool["description"]} if tool.get("description") else {}),
         "input_schema": tool.get("input_schema")}
    return json.dumps(d, ensure_ascii=False)


def anthropic_tools_text(tools: Any) -> str:
    """The system text block the tools become ('' without tools); the text of ``tools[:k]`` is a
    prefix of the text of ``tools``."""
    return tools_block([anthropic_tool_line(t) for t in _dicts(tools)])


def anthropic_system_text(tools: Any, system: Any) -> str:
    """Tools first, then the system text (a string or text blocks)."""
    return before_system(anthropic_tools_text(tools), content_text(system))


def anthropic_chat(system: Any, messages: Any, tools: Any = None) -> list[Message]:
    """/v1/messages' ``system``, ``messages`` and ``tools`` as the template sees them."""
    text = anthropic_system_text(tools, system)
    head = [{"role": "system", "content": text}] if text else []
    return head + [{"role": m.get("role"), "content": content_text(m.get("content"))} for m in _dicts(messages)]


# ------------------------------------------------------------------------------- Ollama
def ollama_chat(messages: Any, tools: Any = None) -> list[Message]:
    """/api/chat's ``messages`` (a system message is one of them) and ``tools``: the same forms as
    OpenAI's (a ``tool`` message, an assistant's ``tool_calls`` with arguments as an object)."""
    return openai_chat(messages, tools)


def ollama_generate(prompt: Any, system: Any = None) -> list[Message]:
    """/api/generate without ``raw``: ``system`` (if any), then the prompt as the user's message."""
    return ([{"role": "system", "content": system}] if isinstance(system, str) and system else []) + [
        {"role": "user", "content": _str(prompt)}]
