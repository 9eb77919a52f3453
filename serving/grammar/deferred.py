"""A grammar backend built on its first use, not at engine start.

Building xgrammar's backend costs about 0.6 CPU-seconds at every engine start (the tokenizer's
vocabulary decoded into its tokenizer info, two compilers) and most engines never see a grammar.
:class:`DeferredBackend` keeps the factory and builds the backend the first time one of its
methods is called; every method then forwards to the built one.

Who builds it: in the engine, a grammar's trial starts the compile workers first, and the first
worker start asks for ``worker_spec`` on its ``grammar-trial`` thread, so that thread builds the
backend. The scheduler thread calls the backend only for a request whose grammar has compiled
(matchers, masks, jump-forward), by which time it is built: it never waits for the build. A
backend that fails to build fails the grammars waiting for it (their compile worker "could not
start") and is tried again for the next one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from serving.grammar.base import GrammarBackend, Matcher


class DeferredBackend(GrammarBackend):
    """Concurrency contract: any thread may call any method; the first call builds the backend
    while holding ``_lock`` (a call from another thread at that time waits for the build); after
    it, calls go straight to the built backend (whose own contract then holds)."""

    def __init__(self, name: str, vocab_size: int, factory: Callable[[], GrammarBackend]) -> None:
        self.name = name
        self.vocab_size = vocab_size
        self._factory = factory
        self._lock = threading.Lock()
        self._backend: GrammarBackend | None = None

    @property
    def built(self) -> bool:
        return self._backend is not None

    def get(self) -> GrammarBackend:
        """The backend, built now if this is the first call."""
        backend = self._backend
        if backend is None:
            with self._lock:
                if self._backend is None:
                    self._backend = self._factory()
                backend = self._backend
        return backend

    def parse(self, kind: str, text: str) -> Any:
        return self.get().parse(kind, text)

    def compile(self, parsed: Any) -> Any:
        return self.get().compile(parsed)

    def worker_spec(self) -> tuple[str, Any]:
        return self.get().worker_spec()

    def new_matcher(self, compiled: Any) -> Matcher:
        return self.get().new_matcher(compiled)

    def allocate_mask(self, rows: int) -> torch.Tensor:
        return self.get().allocate_mask(rows)

    def fill_masks(self, matchers: Sequence[Matcher], mask: torch.Tensor, rows: Sequence[int]) -> None:
        self.get().fill_masks(matchers, mask, rows)

    def apply_masks(self, logits: torch.Tensor, mask: torch.Tensor, rows: Sequence[int]) -> None:
        self.get().apply_masks(logits, mask, rows)

    def forced_token(self, matcher: Matcher) -> int | None:
        return self.get().forced_token(matcher)
