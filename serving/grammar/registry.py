"""Grammar backends by name (``--grammar-backend``); ``none`` turns structured output off."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from serving.grammar.base import GrammarBackend

# name -> factory(hf_tokenizer, vocab_size, stop_token_ids); imported lazily so that the
# config can name a backend without importing its library.
_FACTORIES: dict[str, Callable[[Any, int, Sequence[int]], GrammarBackend]] = {}


def _xgrammar(tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> GrammarBackend:
    from serving.grammar.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, stop_ids)


def _llguidance(tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> GrammarBackend:
    from serving.grammar.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(tokenizer, vocab_size, stop_ids)


def register_grammar_backend(name: str, factory: Callable[[Any, int, Sequence[int]], GrammarBackend]) -> None:
    _FACTORIES[name] = factory


register_grammar_backend("xgrammar", _xgrammar)
register_grammar_backend("llguidance", _llguidance)
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")  # the names the config accepts


def grammar_backend_factory(name: str) -> Callable[[Any, int, Sequence[int]], GrammarBackend]:
    """The factory registered as ``name``; ValueError naming the known ones otherwise."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown grammar backend {name!r} (known: {', '.join([*_FACTORIES, 'none'])})")
    return _FACTORIES[name]

