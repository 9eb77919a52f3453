"""Config fields that document themselves: enumerated values and one-line descriptions.

- An enumerated field is declared with :func:`choice`: ``schedule_policy: str = choice("lpm",
  SCHEDULE_NAMES)``; the names may be a callable (a registry read when first needed, so a
  config module need not import its registry, nor torch, at import time). The dataclass's
  ``__post_init__`` calls :func:`check_choices` once, which refuses any other value with one line
  naming the field, the value and the allowed names.
- A field's description is its comment in the class's source: the trailing ``# ...`` on the
  field's line, else the comment block right above it (parsed once per class; a blank line ends
  a block); every field has one (tests/server/test_cli_help.py checks). ``hicache serve --help`` shows
  it with the allowed values and the effective default.

Torch-free, imported by every config module (hicache and serving alike).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import tokenize
from collections.abc import Callable, Iterable
from typing import Any

Names = Iterable[str] | Callable[[], Iterable[str]]


def choice(default: Any, names: Names, *, optional: bool = False) -> Any:
    """A dataclass field whose value must be one of ``names`` (``None`` too when ``optional``)."""
    return dataclasses.field(default=default, metadata={"choices": names, "optional": optional})


def field_choices(f: dataclasses.Field) -> tuple[str, ...] | None:
    """The allowed values of an enumerated field, in declaration order; None for other fields."""
    names = f.metadata.get("choices")
    if names is None:
        return None
    return tuple(names() if callable(names) else names)


def check_choices(obj: Any) -> None:
    """ValueError (one line: field, value, allowed names) for an enumerated field of ``obj`` set
    to anything else."""
    for f in dataclasses.fields(obj):
        allowed = field_choices(f)
        if allowed is None:
            continue
        value = getattr(obj, f.name)
        if value is None and f.metadata.get("optional"):
            continue
        if value not in allowed:
            extra = " (or unset)" if f.metadata.get("optional") else ""
            raise ValueError(f"{f.name} must be one of {', '.join(allowed)}{extra}, got {value!r}")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``field -> description`` from the comments in ``cls``'s source (see the module docstring);
    empty when the source cannot be read (an installation without .py files)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    docs: dict[str, str] = {}
    block: list[str] = []  # the comment lines since the last field or blank line
    field_line: dict[int, str] = {}  # line number -> the field declared on it
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            line_field = field_line.get(tok.start[0])
            if line_field is not None:  # trailing: it describes this line's field only
                docs[line_field] = text
                block = []
            else:
                block.append(text)
        elif tok.type == tokenize.NL and not tok.line.strip():
            block = []  # a blank line ends a comment block
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string in names:  # a field's line
            field_line[tok.start[0]] = tok.string
            if block:
                docs[tok.string] = " ".join(block)
            block = []
    return {k: v for k, v in docs.items() if v}
