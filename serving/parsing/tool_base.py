"""What every tool-call parser shares: a parsed call, a parse's result, and the parser's contract.

A parser reads the model's text (after any reasoning was taken out) and splits it into items,
in order: plain text (``str``) and calls (:class:`ToolCall`). ``parse(text, final=False)`` is
the streaming form: it may hold back a tail it cannot decide yet (an unfinished call, or text
that could be the start of a call's marker), and ``held`` says where that tail begins. Every
decision it makes on the text before ``held`` is the one it makes on any longer text: what a
stream shows is always a prefix of the final answer (serving/parsing/tool_stream.py relies on it).
A call that does not parse (not JSON, no name, arguments not an object) stays text: the answer
is never an error because of what the model wrote.

``structure(name)`` is the text one call to ``name`` is written as, its arguments left out
(``begin``, ``end``): the structural tag that forces calls (serving/parsing/tool_grammar.py)
writes exactly what ``parse`` reads. Parsers are stateless: one instance serves every request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's form)

    @property
    def input(self) -> dict[str, Any]:  # Anthropic's / Ollama's form
        return json.loads(self.arguments)


@dataclass(frozen=True)
class Parsed:
    items: list[str | ToolCall] = field(default_factory=list)
    held: int = 0  # text[held:] is not decided yet (0 items past it); len(text) when final

    @property
    def calls(self) -> list[ToolCall]:
        return [i for i in self.items if isinstance(i, ToolCall)]

    @property
    def content(self) -> str:
        return "".join(i for i in self.items if isinstance(i, str))


@dataclass(frozen=True)
class Structure:
    begin: str  # the text before the arguments object
    end: str  # the text after it
    trigger: str  # the marker every call of the format starts with


class ToolParser:
    """A format: ``names`` are SGLang's ``--tool-call-parser`` names for it."""

    names: ClassVar[tuple[str, ...]] = ()
    # the format's markers are special tokens in its models' vocabularies: keep them in the text
    keeps_special_tokens: ClassVar[bool] = False
    separator: ClassVar[str] = "\n"  # between two forced calls

    def parse(self, text: str, final: bool = True) -> Parsed:
        raise NotImplementedError

    def structure(self, name: str) -> Structure:
        raise NotImplementedError


def call_from(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """``{"name": str, "arguments"|"parameters": {...}}`` (arguments may be JSON text of an object)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in args_keys if k in obj), None)
    args: Any = {} if key is None else obj[key]
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def loads_object(text: str) -> Any:
    """``text`` as one JSON value, or None."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def marker_tail(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Where a suffix of ``text[start:]`` that is a proper prefix of a marker begins (else len)."""
    for i in range(max(start, len(text) - max(len(m) for m in markers) + 1), len(text)):
        if any(m.startswith(text[i:]) for m in markers):
            return i
    return len(text)


def find_first(text: str, start: int, markers: tuple[str, ...]) -> tuple[int, str]:
    """The first marker at or after ``start``: (position, marker), or (-1, "")."""
    best = (-1, "")
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best[0] < 0 or i < best[0]):
            best = (i, m)
    return best


def delimited(text: str, final: bool, begin: str, end: str,
              read: Any) -> Parsed:
    """The common shape: calls are ``begin BODY end`` anywhere in the text; ``read(body)`` is the
    call or None (then the whole ``begin BODY end`` stays text). An unfinished call at the end is
    held while streaming and text when final."""
    items: list[str | ToolCall] = []
    pos = 0
    while True:
        i = text.find(begin, pos)
        if i < 0:
            cut = len(text) if final else marker_tail(text, pos, (begin,))
            _text(items, text[pos:cut])
            return Parsed(items, cut)
        j = text.find(end, i + len(begin))
        if j < 0:
            if final:
                _text(items, text[pos:])
                return Parsed(items, len(text))
            _text(items, text[pos:i])
            return Parsed(items, i)
        call = read(text[i + len(begin): j])
        if call is None:
            _text(items, text[pos: j + len(end)])
        else:
            _text(items, text[pos:i])
            items.append(call)
        pos = j + len(end)


def _text(items: list[str | ToolCall], s: str) -> None:
    if not s:
        return
    if items and isinstance(items[-1], str):
        items[-1] += s
    else:
        items.append(s)


add_text = _text
