"""A chat answer's reasoning and tool calls on the HTTP routes (OpenAI, Anthropic, Ollama).

The server's ``--tool-call-parser`` / ``--reasoning-parser`` (serving/parsing) apply to a request
as it asks: tool calls are parsed only when the request gives tools and ``tool_choice`` is not
``none``; reasoning is split off unless ``separate_reasoning`` is false. ``tool_choice``
``required`` or a named function is constrained decoding: a structural tag of the parser's own
call format around the tools' parameter schemas (serving/parsing/tool_grammar.py), so the calls
are there and their arguments validate. A grammar (``response_format``, a forced call) applies to
the answer after the reasoning: when the prompt leaves the answer inside the reasoning (the parser's
``forced``) and its end marker is one token, the grammar waits for that token
(``grammar_after_token_id``); a model that opens the reasoning itself is constrained from its
first token. Stateless functions; the parsers are shared, read-only.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from serving.parsing.output import OutputParser
from serving.parsing.reasoning_registry import reasoning_parser
from serving.parsing.tool_grammar import forced_calls
from serving.parsing.tool_registry import tool_parser
from serving.server.context import ServerContext
from serving.server.errors import APIError
from serving.structs.grammar_spec import GRAMMAR_KINDS


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools, in OpenAI's terms (the Anthropic and Ollama faces map onto it)."""

    tools: list[dict[str, Any]]  # function definitions: name, description, parameters
    choice: str = "auto"  # auto | none | required | function (then ``name``)
    name: str | None = None
    parallel: bool = True

    @property
    def renders(self) -> bool:  # tool_choice none: the tools are not shown to the model
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.renders and self.choice in ("required", "function")


def check_choice(tools: list[dict[str, Any]], choice: str, name: str | None, param: str) -> None:
    """ValueError for a tool_choice that cannot be met by these tools."""
    if choice in ("required", "function") and not tools:
        raise ValueError(f"{param}: {choice!r} needs tools")
    if choice == "function" and name not in {t["name"] for t in tools}:
        raise ValueError(f"{param}: no tool is named {name!r}")


def output_parser(ctx: ServerContext, tools: ToolRequest | None, separate_reasoning: bool,
                  prompt_ids: list[int]) -> OutputParser:
    """The request's parser; a 400 for a forced call on a server without ``--tool-call-parser``."""
    tp = tool_parser(ctx.server.tool_call_parser) if tools is not None and tools.renders else None
    if tools is not None and tools.forced and tp is None:
        raise APIError(400, f"tool_choice {tools.choice!r} needs the server started with --tool-call-parser",
                       param="tool_choice")
    rp = reasoning_parser(ctx.server.reasoning_parser) if separate_reasoning else None
    forced = False
    if rp is not None and ctx.tokenizer is not None:
        forced = rp.forced(ctx.tokenizer.decode(prompt_ids[-64:], False))
    return OutputParser(rp, forced, tp)


def _forced_call_params(parser: OutputParser, tools: ToolRequest | None) -> dict[str, Any]:
    """The sampling params that force the calls (``structural_tag``), or none."""
    if tools is None or not tools.forced or parser.tools is None:
        return {}
    name = tools.name if tools.choice == "function" else None
    return {"structural_tag": forced_calls(parser.tools, tools.tools, name, tools.parallel)}


def answer_params(ctx: ServerContext, parser: OutputParser, tools: ToolRequest | None,
                  params: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling ``params`` with what its parser needs: the structural tag that forces
    calls, special tokens kept where the format's markers are special tokens, and a grammar that
    waits for the end of the reasoning the prompt left open."""
    out = {**params, **_forced_call_params(parser, tools)}
    if parser.keeps_special_tokens:
        out["skip_special_tokens"] = False
    if parser.reasoning is not None and parser.forced and any(out.get(k) is not None for k in GRAMMAR_KINDS):
        ids = ctx.tokenizer.encode(parser.reasoning.end) if ctx.tokenizer is not None else []
        if len(ids) == 1:
            out["grammar_after_token_id"] = ids[0]
    return out


def strip_eos(ctx: ServerContext, parser: OutputParser, text: str) -> str:
    """The text parsers read: with special tokens kept (a format's markers), less a trailing EOS."""
    eos = getattr(getattr(ctx.tokenizer, "hf", None), "eos_token", None)
    if parser.keeps_special_tokens and isinstance(eos, str) and eos and text.endswith(eos):
        return text[: -len(eos)]
    return text


def call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]
