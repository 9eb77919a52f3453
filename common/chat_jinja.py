"""Rendering a HF chat template (Jinja) the way ``transformers`` renders it, without importing it.

What ``PreTrainedTokenizerBase.apply_chat_template(messages, tokenize=False)`` does to the text
(transformers 5.x, ``utils/chat_template_utils.py``), rebuilt on Jinja's public API:
- the environment: sandboxed and immutable, ``trim_blocks`` and ``lstrip_blocks``, the
  ``loopcontrols`` extension and a ``{% generation %}`` block that renders its body (transformers
  uses it to mark assistant tokens; its text is the body's);
- the template's names: ``raise_exception(msg)`` (a ``TemplateError``), ``strftime_now(fmt)``
  (local time), a ``tojson`` filter that keeps non-ASCII and takes ``indent`` / ``separators`` /
  ``sort_keys``, a ``dict`` that only builds dicts, a ``namespace`` that refuses names starting
  with ``_``;
- the inputs: each message without its keys whose value is None, every value rebuilt from plain
  JSON types (anything else becomes ``"<TypeName>"``), a message's reasoning also given as
  ``reasoning_content`` and ``thinking``; the tokenizer's special tokens (``bos_token``, ...) as
  variables, which the caller's keyword arguments override.
tests/models/test_tokenizer_light.py renders templates that use each of these with both and
compares the texts.

Thread-safety: compiled templates are cached (an lru_cache); rendering is re-entrant.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: the body, unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """The template's ``dict``: builds dicts, nothing else reachable."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """The template's ``namespace``: no attribute whose name starts with ``_``."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature: namespace(self=...) works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env.from_string(source)


def plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (str, int, float, bool, None, dict, list, tuple);
    anything else becomes ``"<TypeName>"`` (a template only sees data)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and type(value).__module__ == "numpy":
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
           special_tokens: dict[str, Any] | None = None, tools: list[dict] | None = None,
           documents: list[dict] | None = None, **variables: Any) -> str:
    """The text of ``messages`` under the template ``source`` (see the module doc); ``tools``:
    JSON schemas (transformers also takes Python functions: not here)."""
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise TypeError("tools must be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    chat = plain([{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages])
    for m in chat:
        if not isinstance(m, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {m!r}.")
    chat = [_with_reasoning_aliases(m) for m in chat]
    names = plain({**(special_tokens or {}), **variables})
    return compile_template(source).render(messages=chat, tools=plain(tools), documents=plain(documents),
                                           add_generation_prompt=add_generation_prompt, **names)
