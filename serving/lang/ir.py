"""The expressions a program appends to its state (``s += ...``).

Text, role markers, ``gen`` and ``select`` nodes, and lists of them (``"a" + gen("x") + "b"``
builds an :class:`ExprList`). Expressions are plain data; the interpreter
(serving.lang.interpreter) gives them their meaning, in order, on the state's own thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# SGLang's frontend sampling defaults (a program's run() may override them for all its gen calls)
DEFAULT_SAMPLING: dict[str, Any] = {"max_new_tokens": 128, "temperature": 1.0}
SAMPLING_NAMES = ("max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
                  "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "seed", "n",
                  "regex", "json_schema", "ebnf", "skip_special_tokens")


class Expr:
    """Anything that can be appended to a state; ``+`` concatenates."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), self])

    def label(self) -> str:
        return type(self).__name__


@dataclass(eq=False)
class Text(Expr):
    value: str

    def label(self) -> str:
        return f"text {self.value[:24]!r}"


@dataclass(eq=False)
class ExprList(Expr):
    items: list[Expr] = field(default_factory=list)

    def __add__(self, other: Any) -> ExprList:
        return ExprList([*self.items, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), *self.items])


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class Gen(Expr):
    """``gen(name, ...)``: generate, store the text under ``name``. ``params`` are SGLang sampling
    params (``max_tokens`` is already ``max_new_tokens``); unset ones come from the run."""

    name: str | None
    params: dict[str, Any]
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False
    dtype: type | None = None  # int or float: the text is parsed into it (SGLang's ``dtype``)

    def label(self) -> str:
        return f"gen({self.name!r})"


@dataclass(eq=False)
class Select(Expr):
    """``select(name, choices)``: score every choice by its token logprobs after the text so far,
    append and store the best one (``choices_method``: serving.lang.choices)."""

    name: str | None
    choices: list[str]
    temperature: float = 0.0
    choices_method: Any = None

    def label(self) -> str:
        return f"select({self.name!r})"


def to_expr(x: Any) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return Text(str(x))
    raise TypeError(f"cannot append a {type(x).__name__} to a program state (text, gen, select or a role)")


def role(name: str, content: Any = None) -> Expr:
    """``system/user/assistant(content)``: the role's prefix, the content, its suffix. With no
    content only the begin marker (``user_begin()``-style use)."""
    if content is None:
        return RoleBegin(name)
    return ExprList([RoleBegin(name), to_expr(content), RoleEnd(name)])
