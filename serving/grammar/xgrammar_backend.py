"""The xgrammar backend: tokenizer info built once from the model's HF tokenizer, a compiler
with xgrammar's own cache, matchers, and the batch bitmask fill / apply."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from serving.grammar.base import GrammarBackend, GrammarError, Matcher

_LOG_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def clean_error(e: BaseException) -> str:
    """xgrammar's C++ message without its log prefix ([time] file.cc:line: Check failed ...)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", text))
    return text[:300]


def parse_grammar(kind: str, text: str) -> xgr.Grammar:
    """``text`` of ``kind`` as an xgrammar Grammar; GrammarError names the problem."""
    try:
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as e:
                raise GrammarError(f"invalid json_schema: not valid JSON ({e})") from None
            if not isinstance(schema, dict | bool):
                raise GrammarError("invalid json_schema: a schema must be a JSON object")
            # compact JSON (fixed separators ", " and ": "): small models otherwise tend to
            # emit runs of whitespace, and a fixed layout gives jump-forward more to skip
            return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(text)
    except GrammarError:
        raise
    except RecursionError:
        raise GrammarError(f"invalid {kind}: nested too deeply") from None
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with the C++ message
        raise GrammarError(f"invalid {kind}: {clean_error(e)}") from None
    raise GrammarError(f"unknown grammar kind {kind!r}")


def compile_grammar(compiler: xgr.GrammarCompiler, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
    try:
        return compiler.compile_grammar(grammar)
    except Exception as e:
        raise GrammarError(f"the grammar failed to compile: {clean_error(e)}") from None


def worker_compiler(config: dict[str, Any]) -> Callable[[str, str], None]:
    """In a compile worker process (see compile_worker): parse and compile, keep nothing."""
    info = xgr.TokenizerInfo.deserialize_json(config["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=int(config["threads"]), cache_enabled=False)

    def trial(kind: str, text: str) -> None:
        compile_grammar(compiler, parse_grammar(kind, text))

    return trial


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int],
                 cache_limit_bytes: int = 256 * 2**20) -> None:
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids) or None)
        self.threads = threads = max(1, min(8, os.cpu_count() or 1))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_limit_bytes=cache_limit_bytes)
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads=threads)
        self.stop_ids = frozenset(self.info.stop_token_ids)
        self._scratch = xgr.allocate_token_bitmask(1, vocab_size)  # jump-forward checks (scheduler thread)

    # -- grammars --------------------------------------------------------------------------
    def parse(self, kind: str, text: str) -> xgr.Grammar:
        return parse_grammar(kind, text)

    def compile(self, parsed: xgr.Grammar) -> xgr.CompiledGrammar:
        return compile_grammar(self.compiler, parsed)

    def worker_spec(self) -> tuple[str, Any]:
        return f"{__name__}:worker_compiler", {"tokenizer_info": self.info.serialize_json(),
                                               "threads": self.threads}

    def new_matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    # -- masks -----------------------------------------------------------------------------
    def allocate_mask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill_masks(self, matchers: Sequence[Matcher], mask: torch.Tensor, rows: Sequence[int]) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, rows[0])  # type: ignore[attr-defined]
        else:
            self.batch_matcher.batch_fill_next_token_bitmask(list(matchers), mask, list(rows))

    def apply_masks(self, logits: torch.Tensor, mask: torch.Tensor, rows: Sequence[int]) -> None:
        mask = mask[: logits.shape[0]]
        if mask.device != logits.device:
            mask = mask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=list(rows))

    def forced_token(self, matcher: Matcher) -> int | None:
        m: xgr.GrammarMatcher = matcher  # type: ignore[assignment]
        if m.is_terminated():
            return None
        # Cheap gate: when no text is forced and the grammar cannot end here, several tokens
        # are allowed. Only a speed-up: the single-token check below decides.
        if not m.find_jump_forward_string() and not m.is_completed():
            return None
        m.fill_next_token_bitmask(self._scratch, 0)
        return single_set_bit(self._scratch[0], self.vocab_size)


def single_set_bit(row: torch.Tensor, vocab_size: int) -> int | None:
    """The one token a bitmask row allows, or None when it allows zero or several."""
    words = row.numpy().view(np.uint32)
    nz = np.flatnonzero(words)
    if len(nz) != 1:
        return None
    w = int(words[nz[0]])
    if w & (w - 1):
        return None
    tok = int(nz[0]) * 32 + w.bit_length() - 1
    return tok if tok < vocab_size else None
