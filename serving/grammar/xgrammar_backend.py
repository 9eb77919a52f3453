"""The xgrammar backend: tokenizer info built once from the model's HF tokenizer, a compiler
with xgrammar's own cache, matchers, and the batch bitmask fill / apply.

Jump-forward asks, after every token of a constrained request, whether the grammar forces
the next one. xgrammar's own answer, ``find_jump_forward_string``, walks the whole forced
string with no bound: ``root ::= "ab" root`` or a self-referencing JSON schema force an
infinite one (the engine grew ~0.5 GB/s until the OOM killer ended it), and a 300-byte
grammar of rules that double (``r1 ::= r0 r0`` ...) forces 2^n characters. It is never
called. Each grammar is compiled a second time over a 256-token vocabulary of single bytes,
and each request's :class:`XMatcher` keeps that byte matcher in step with its token matcher:
"exactly one next byte" is then a 256-bit mask fill (microseconds, bounded like any mask
fill), the cheap gate before the token mask decides (``forced_token``). The runner bounds
how many tokens one jump looks ahead (``runner.jump_forward``)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import xgrammar as xgr

from serving.grammar.base import GrammarBackend, GrammarError, Matcher, check_json_schema
from serving.grammar.bitmask import bit_count, single_set_bit

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
            check_json_schema(text)
            # compact JSON (fixed separators ", " and ": "): small models otherwise tend to
            # emit runs of whitespace, and a fixed layout gives jump-forward more to skip
            return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(text)
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(text)
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


def byte_tokenizer_info() -> xgr.TokenizerInfo:
    """A vocabulary of the 256 single bytes, no stop token: the byte twin of every grammar."""
    return xgr.TokenizerInfo([bytes([i]) for i in range(256)], vocab_type=xgr.VocabType.RAW)


def worker_compiler(config: dict[str, Any]) -> Callable[[str, str], None]:
    """In a compile worker process (see compile_worker): parse and compile (over the model's
    vocabulary and over the bytes, as the engine will), keep nothing."""
    info = xgr.TokenizerInfo.deserialize_json(config["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=int(config["threads"]), cache_enabled=False)
    byte_compiler = xgr.GrammarCompiler(byte_tokenizer_info(), max_threads=1, cache_enabled=False)

    def trial(kind: str, text: str) -> None:
        parsed = parse_grammar(kind, text)
        compile_grammar(compiler, parsed)
        compile_grammar(byte_compiler, parsed)

    return trial


class XMatcher:
    """A request's matcher: xgrammar's over the model's vocabulary (``tokens``: the masks),
    and its byte twin (``bytes``), advanced by the same text, which answers whether the next
    byte is forced. A stop token advances only ``tokens`` (it ends the match). Should the
    twin ever refuse text that ``tokens`` accepted, it is dropped: that request then runs
    without jump-forward, which is always exact."""

    __slots__ = ("tokens", "bytes", "_vocab")

    def __init__(self, tokens: xgr.GrammarMatcher, twin: xgr.GrammarMatcher, vocab: Sequence[bytes]) -> None:
        self.tokens, self.bytes, self._vocab = tokens, twin, vocab

    def accept_token(self, token_id: int) -> bool:
        if not self.tokens.accept_token(token_id):
            return False
        if self.bytes is not None and not self.tokens.is_terminated():
            text = self._vocab[token_id] if 0 <= token_id < len(self._vocab) else None
            if text is None or not self.bytes.accept_string(text):
                self.bytes = None
        return True

    def accept_string(self, text: str | bytes) -> bool:
        if not self.tokens.accept_string(text):
            return False
        if self.bytes is not None and not self.bytes.accept_string(text):
            self.bytes = None
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self.bytes is not None:  # a stop token (only ever the last one) did not reach the twin
            self.bytes.rollback(num_tokens - int(self.tokens.is_terminated()))
        self.tokens.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.tokens.is_terminated()

    def is_completed(self) -> bool:
        return self.tokens.is_completed()


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int],
                 cache_limit_bytes: int = 256 * 2**20) -> None:
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids) or None)
        self.threads = threads = max(1, min(8, os.cpu_count() or 1))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_limit_bytes=cache_limit_bytes)
        self.byte_compiler = xgr.GrammarCompiler(byte_tokenizer_info(), max_threads=1,
                                                 cache_limit_bytes=cache_limit_bytes // 8)
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads=threads)
        self.stop_ids = frozenset(self.info.stop_token_ids)
        vocab = self.info.decoded_vocab  # the bytes of each token id (the twin's input)
        self._vocab = [bytes(t) for t in vocab]
        # jump-forward checks (scheduler thread only)
        self._scratch = xgr.allocate_token_bitmask(1, vocab_size)
        self._byte_scratch = xgr.allocate_token_bitmask(1, 256)

    # -- grammars --------------------------------------------------------------------------
    def parse(self, kind: str, text: str) -> xgr.Grammar:
        return parse_grammar(kind, text)

    def compile(self, parsed: xgr.Grammar) -> tuple[xgr.CompiledGrammar, xgr.CompiledGrammar]:
        """The grammar over the model's vocabulary and its byte twin (see XMatcher)."""
        return compile_grammar(self.compiler, parsed), compile_grammar(self.byte_compiler, parsed)

    def worker_spec(self) -> tuple[str, Any]:
        return f"{__name__}:worker_compiler", {"tokenizer_info": self.info.serialize_json(),
                                               "threads": self.threads}

    def new_matcher(self, compiled: tuple[xgr.CompiledGrammar, xgr.CompiledGrammar]) -> XMatcher:
        tokens, twin = compiled
        return XMatcher(xgr.GrammarMatcher(tokens), xgr.GrammarMatcher(twin), self._vocab)

    # -- masks -----------------------------------------------------------------------------
    def allocate_mask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill_masks(self, matchers: Sequence[Matcher], mask: torch.Tensor, rows: Sequence[int]) -> None:
        tokens = [m.tokens for m in matchers]  # type: ignore[attr-defined]
        if len(tokens) == 1:
            tokens[0].fill_next_token_bitmask(mask, rows[0])
        else:
            self.batch_matcher.batch_fill_next_token_bitmask(tokens, mask, list(rows))

    def apply_masks(self, logits: torch.Tensor, mask: torch.Tensor, rows: Sequence[int]) -> None:
        mask = mask[: logits.shape[0]]
        if mask.device != logits.device:
            mask = mask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=list(rows))

    def forced_token(self, matcher: Matcher) -> int | None:
        m: XMatcher = matcher  # type: ignore[assignment]
        if m.is_terminated() or m.bytes is None:
            return None
        # Cheap gate (bounded: a mask over 256 bytes): several tokens are allowed when several
        # next bytes are, or when the grammar may end here (a stop token) and also go on. Only
        # a speed-up (a tokenizer may lack a byte's token): the token mask below decides.
        m.bytes.fill_next_token_bitmask(self._byte_scratch, 0)
        if bit_count(self._byte_scratch[0]) != (0 if m.tokens.is_completed() else 1):
            return None
        m.tokens.fill_next_token_bitmask(self._scratch, 0)
        return single_set_bit(self._scratch[0], self.vocab_size)

