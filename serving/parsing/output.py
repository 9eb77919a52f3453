"""A chat answer's text -> reasoning, content and tool calls, whole or as a stream.

:class:`OutputParser` runs the request's reasoning parser (if any), then its tool parser (if any)
on what is left. :class:`OutputStream` re-parses the text seen so far after each update and
sends what is new: reasoning pieces, content pieces and whole calls, in the answer's order.
The parsers hold back what they cannot decide yet (serving/parsing/tool_base.py), so the pieces
a stream sends add up to the final parse, wherever the text was split. One per request; not
shared between threads."""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.parsing.reasoning import ReasoningParser
from serving.parsing.tool_base import ToolCall, ToolParser


@dataclass(frozen=True)
class Output:
    reasoning: str = ""
    items: list[str | ToolCall] = field(default_factory=list)

    @property
    def content(self) -> str:
        return "".join(i for i in self.items if isinstance(i, str))

    @property
    def calls(self) -> list[ToolCall]:
        return [i for i in self.items if isinstance(i, ToolCall)]


@dataclass(frozen=True)
class OutputParser:
    reasoning: ReasoningParser | None = None
    forced: bool = False  # the answer starts inside the reasoning (ReasoningParser.forced)
    tools: ToolParser | None = None

    @property
    def keeps_special_tokens(self) -> bool:
        return any(p is not None and p.keeps_special_tokens for p in (self.reasoning, self.tools))

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def parse(self, text: str, final: bool = True) -> Output:
        reasoning = ""
        if self.reasoning is not None:
            split = self.reasoning.parse(text, self.forced, final)
            reasoning, text = split.reasoning, split.content
        if self.tools is None:
            return Output(reasoning, [text] if text else [])
        return Output(reasoning, self.tools.parse(text, final).items)


@dataclass(frozen=True)
class Piece:
    kind: str  # "reasoning" | "content" | "call"
    text: str = ""
    call: ToolCall | None = None
    index: int = 0  # a call's index among the answer's calls


class OutputStream:
    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.sent_reasoning = 0
        self.sent_content = 0
        self.sent_calls = 0

    def update(self, text: str, final: bool = False) -> list[Piece]:
        """The new pieces, given the whole text so far (``final``: the answer is complete)."""
        out = self.parser.parse(text, final)
        pieces: list[Piece] = []
        if len(out.reasoning) > self.sent_reasoning:
            pieces.append(Piece("reasoning", out.reasoning[self.sent_reasoning:]))
            self.sent_reasoning = len(out.reasoning)
        at, calls = 0, 0
        for item in out.items:
            if isinstance(item, str):
                end = at + len(item)
                if end > self.sent_content:
                    pieces.append(Piece("content", item[max(self.sent_content - at, 0):]))
                    self.sent_content = end
                at = end
            else:
                if calls >= self.sent_calls:
                    pieces.append(Piece("call", call=item, index=calls))
                    self.sent_calls = calls + 1
                calls += 1
        return pieces
