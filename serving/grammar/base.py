"""The grammar-backend contract: parse and compile (both may be slow: run on worker threads,
after a trial in a worker process, see ``compile_pool``), per-request matchers, token masks
filled for a batch and applied to logits."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import torch


class GrammarError(ValueError):
    """A JSON schema, regex or grammar the backend cannot use; the message names the problem."""


def check_json_schema(text: str) -> None:
    """GrammarError unless ``text`` is JSON holding a schema (an object, or true / false)."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid json_schema: not valid JSON ({e})") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError("invalid json_schema: a schema must be a JSON object")


class Matcher(Protocol):
    """A request's position in its grammar (one per request, advanced token by token)."""

    def accept_token(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...


class GrammarBackend(ABC):
    """One grammar engine bound to one tokenizer / vocabulary (the model's logits width)."""

    name: str = ""
    vocab_size: int = 0

    @abstractmethod
    def parse(self, kind: str, text: str) -> Any:
        """Check ``text`` of ``kind`` (json_schema / regex / ebnf); raise GrammarError naming
        the problem. No tokenizer work, but not always cheap (a schema of many integer ranges:
        ~10 us per byte): runs on a worker thread, never on the scheduler's."""

    @abstractmethod
    def compile(self, parsed: Any) -> Any:
        """The compiled grammar of a ``parse`` result (GrammarError if it fails); runs on a
        worker thread, and only for a grammar whose trial compiled within the time budget."""

    @abstractmethod
    def worker_spec(self) -> tuple[str, Any]:
        """How a compile worker process (``compile_worker``) rebuilds this backend's parse and
        compile for trials: ``("module:function", config)``, where ``function(config)`` (run
        in the worker; ``config`` msgpack-able) returns ``compile(kind, text)`` that parses and
        compiles, raising GrammarError for a grammar it cannot use."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> Matcher: ...

    @abstractmethod
    def allocate_mask(self, rows: int) -> torch.Tensor:
        """A host mask buffer with ``rows`` rows (every token allowed)."""

    @abstractmethod
    def fill_masks(self, matchers: Sequence[Matcher], mask: torch.Tensor, rows: Sequence[int]) -> None:
        """Fill ``mask[rows[i]]`` with the next-token mask of ``matchers[i]`` (thread-safe)."""

    @abstractmethod
    def apply_masks(self, logits: torch.Tensor, mask: torch.Tensor, rows: Sequence[int]) -> None:
        """Set the logits of disallowed tokens to -inf, in place, for ``rows`` only."""

    @abstractmethod
    def forced_token(self, matcher: Matcher) -> int | None:
        """The next token when the grammar allows exactly one, else None (see runner: jump-forward)."""
