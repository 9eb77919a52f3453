"""The llguidance backend (``--grammar-backend llguidance``; pip ``llguidance``): the tokenizer
built once from the model's HF tokenizer, grammars as llguidance's JSON grammar text, matchers
copied from one compiled per grammar, the batch mask fill on llguidance's own threads.

Kinds: ``json_schema`` (compact separators ``", "`` / ``": "`` and no free whitespace, as the
xgrammar backend writes it), ``regex``, ``ebnf`` (the GBNF dialect the xgrammar backend takes,
converted to Lark by llguidance's ``gbnf_to_lark``). ``structural_tag`` (and so ``tool_choice``
required / named) is xgrammar's format: a 400 naming the backend to use.

Same contract as every backend (serving/grammar/base.py): ``parse`` and ``compile`` run off
the scheduler thread (the compile is first tried in a worker process killed past the time
budget, ``compile_pool``), so one grammar can never stall the engine; llguidance's own parser
limits (lexer fuel, Earley items per step) bound every mask. A matcher ends when it accepts a
stop token (llguidance stops as soon as only a stop token can follow; the request then samples
it, as with xgrammar, or jump-forward appends it). Jump-forward: llguidance's forced bytes (or its
"only a stop token can follow") are the cheap gate, the token mask decides (one allowed token), so
a run is what step-by-step decoding would pick.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import llguidance.torch as llt
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from serving.grammar.base import GrammarBackend, GrammarError, Matcher, check_json_schema
from serving.grammar.bitmask import apply_bitmask, single_set_bit

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def parse_grammar(kind: str, text: str) -> str:
    """``text`` of ``kind`` as llguidance grammar text; GrammarError names the problem."""
    if kind == "json_schema":
        check_json_schema(text)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"invalid json_schema: {e}") from None
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(text)
    elif kind == "ebnf":
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(text))
        except RecursionError:
            raise GrammarError("invalid ebnf: nested too deeply") from None
        except Exception as e:  # gbnf_to_lark raises plain Exceptions naming the rule or position
            raise GrammarError(f"invalid ebnf: {str(e).strip()[:300]}") from None
    elif kind == "structural_tag":
        raise GrammarError("structural_tag (and tool_choice required / a named function) needs "
                           "--grammar-backend xgrammar; this server runs llguidance")
    else:
        raise GrammarError(f"unknown grammar kind {kind!r}")
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"invalid {kind}: {error.strip()[:300]}")
    return grammar


def compile_grammar(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A matcher at the grammar's start (building it compiles the lexer: may take long, drops
    the GIL); GrammarError when llguidance refuses the grammar or hits its limits."""
    m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if m.is_error():
        raise GrammarError(f"the grammar failed to compile: {m.get_error().strip()[:300]}")
    return m


def worker_compiler(config: dict[str, Any]) -> Callable[[str, str], None]:
    """In a compile worker process (see compile_worker): parse and compile, keep nothing."""
    tok = llguidance.LLTokenizer(config["tokenizer"], n_vocab=config["n_vocab"], eos_token=config["eos"])

    def trial(kind: str, text: str) -> None:
        compile_grammar(tok, parse_grammar(kind, text))

    return trial


class LLMatch:
    """A request's matcher: llguidance's, and whether it accepted a stop token (the end)."""

    __slots__ = ("m", "stop_ids", "ended")

    def __init__(self, m: llguidance.LLMatcher, stop_ids: frozenset[int]) -> None:
        self.m, self.stop_ids, self.ended = m, stop_ids, False

    def accept_token(self, token_id: int) -> bool:
        if self.ended:
            return False
        if token_id in self.stop_ids:  # the end: kept here, not in llguidance's matcher (a stopped
            self.ended = self.m.is_accepting()  # one does not count it, and rolling it back undoes more)
            return self.ended
        # checked first: a refused token would leave llguidance's matcher in its error state for good
        return self.m.validate_tokens([token_id]) == 1 and self.m.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self.ended:  # a stop token is only ever the last one
            self.ended, num_tokens = False, num_tokens - 1
        if num_tokens > 0:
            self.m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.ended


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        stops = list(stop_ids) or [tokenizer.eos_token_id]
        self._tokenizer_json = _tokenizer_json(tokenizer)
        self._eos = stops
        self.tok = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=vocab_size, eos_token=stops)
        self.stop_ids = frozenset(stops)
        self.executor = llguidance.LLExecutor()
        self._scratch = llt.allocate_token_bitmask(1, vocab_size)  # jump-forward (scheduler thread only)

    def parse(self, kind: str, text: str) -> str:
        return parse_grammar(kind, text)

    def compile(self, parsed: str) -> llguidance.LLMatcher:
        return compile_grammar(self.tok, parsed)

    def worker_spec(self) -> tuple[str, Any]:
        return f"{__name__}:worker_compiler", {"tokenizer": self._tokenizer_json, "n_vocab": self.vocab_size,
                                               "eos": self._eos}

    def new_matcher(self, compiled: llguidance.LLMatcher) -> LLMatch:
        return LLMatch(compiled.deep_copy(), self.stop_ids)

    def allocate_mask(self, rows: int) -> torch.Tensor:
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill_masks(self, matchers: Sequence[Matcher], mask: torch.Tensor, rows: Sequence[int]) -> None:
        pairs = [(m.m, int(r)) for m, r in zip(matchers, rows, strict=True)]  # type: ignore[attr-defined]
        llt.fill_next_token_bitmask_par(self.executor, pairs, mask)

    def apply_masks(self, logits: torch.Tensor, mask: torch.Tensor, rows: Sequence[int]) -> None:
        apply_bitmask(logits, mask, rows, self.vocab_size)

    def forced_token(self, matcher: Matcher) -> int | None:
        m: LLMatch = matcher  # type: ignore[assignment]
        if m.ended or m.m.is_error():
            return None
        if not m.m.is_stopped() and not m.m.compute_ff_bytes():  # stopped: only a stop token can follow
            return None
        llt.fill_next_token_bitmask(m.m, self._scratch, 0)
        return single_set_bit(self._scratch[0], self.vocab_size)


def _tokenizer_json(tokenizer: Any) -> str:
    """The Rust tokenizer's JSON (added tokens included) of a fast HF tokenizer, as llguidance
    reads it; ValueError for a slow one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("the llguidance grammar backend needs a fast (tokenizer.json) tokenizer")
    from copy import copy

    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()
