"""Tokenizer access (HF ``tokenizer.json`` folders) and incremental detokenization."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from serving.structs.sampling_params import InvalidRequest

PIECE_CHARS = 1 << 15  # a longer text is counted in pieces of about this many characters
PIECE_SLACK = 8  # tokens a cut between two pieces may add to their sum (a word split in two)
LARGE_AT_ONCE = 2  # tokenizations of texts over PIECE_CHARS running at once (the rest wait)


def has_tokenizer(path: str) -> bool:
    return os.path.exists(os.path.join(path, "tokenizer.json")) or os.path.exists(
        os.path.join(path, "tokenizer_config.json"))


class TooManyTokens(InvalidRequest):
    """The text has more than ``limit`` tokens: counting stopped there."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the text has more than {limit} tokens")
        self.limit = limit


class Tokenizer:
    """A HF tokenizer folder's tokenizer (``hf``: common.tokenizer_load's answer, the light one
    when the folder has a snapshot; ``hf_full()``: the HF one, for xgrammar).

    Concurrency: ``encode`` may run in many threads at once (the HTTP server runs it in its
    thread pool); at most LARGE_AT_ONCE of them tokenize a text longer than PIECE_CHARS at a
    time, the others wait on ``_large``, so a burst of huge prompts holds a bounded amount of
    the tokenizer's temporary memory."""

    def __init__(self, path: str) -> None:
        from common.tokenizer_load import load_tokenizer

        self.hf = load_tokenizer(path)
        self.path = path
        self._large = threading.BoundedSemaphore(LARGE_AT_ONCE)
        # the token the tokenizer puts before a text by default (Gemma's <bos>; None: it adds none)
        plain, special = list(self.hf.encode("a", add_special_tokens=False)), list(self.hf.encode("a"))
        self.bos_id: int | None = special[0] if len(special) == len(plain) + 1 and special[1:] == plain else None

    def prompt_ids(self, ids: list[int]) -> list[int]:
        """A raw-text prompt's ids as vLLM / SGLang feed them: the tokenizer's BOS first when it adds one
        and the text does not already start with it (a chat template writes its own)."""
        return ids if self.bos_id is None or ids[:1] == [self.bos_id] else [self.bos_id, *ids]

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """The text's token ids. With ``max_tokens``, a text longer than PIECE_CHARS is counted
        in pieces first (cut before a space where one is near) and TooManyTokens is raised as
        soon as their sum is over ``max_tokens`` (plus PIECE_SLACK per cut), so a text of any
        size costs about ``max_tokens`` tokens of work and memory; one within it is then
        tokenized whole (the ids are always exactly the whole text's, as without the bound)."""
        if max_tokens is None or len(text) <= PIECE_CHARS:
            return self._ids(text)
        with self._large:
            try:
                count, start, cuts = 0, 0, 0
                while start < len(text):
                    end = _cut(text, start + PIECE_CHARS)
                    count += len(self._ids(text[start:end]))
                    if count > max_tokens + PIECE_SLACK * cuts:
                        raise TooManyTokens(max_tokens)
                    start, cuts = end, cuts + 1
                return self._ids(text)
            finally:
                release_freed_memory()

    def _ids(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """``template_kwargs``: the template's own variables (SGLang's ``chat_template_kwargs``,
        e.g. ``enable_thinking``)."""
        if not getattr(self.hf, "chat_template", None):
            raise InvalidRequest("this model has no chat template; use /v1/completions or /generate")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **template_kwargs)

    def hf_full(self) -> Any:
        """The HF tokenizer itself (built on first call when ``hf`` is the light one)."""
        from common.tokenizer_load import hf_tokenizer

        return hf_tokenizer(self.hf)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)


def _cut(text: str, end: int) -> int:
    """Where a piece that should end near ``end`` ends: before the last space in its second
    half (the space starts the next piece's word, as the whole text's pre-tokenizer splits it)."""
    if end >= len(text):
        return len(text)
    space = text.rfind(" ", end - PIECE_CHARS // 2, end)
    return space if space > end - PIECE_CHARS // 2 else end


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6") if os.name == "posix" else None


def release_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim): a large tokenization
    frees its temporaries in the arena of the pool thread that ran it, where they would stay."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def eos_token_ids(model_path: str, tokenizer: Tokenizer | None) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, merged."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        f = os.path.join(model_path, name)
        if os.path.exists(f):
            with open(f) as fh:
                v = json.load(fh).get("eos_token_id")
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, list):
                ids.update(int(x) for x in v)
    if tokenizer is not None and tokenizer.hf.eos_token_id is not None:
        ids.add(int(tokenizer.hf.eos_token_id))
    return sorted(ids)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into a growing text without re-decoding the
    whole output each time and without emitting half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self._prefix_offset = 0  # tokens before this are settled into self.text
        self._read_offset = 0

    def update(self, ids: Sequence[int]) -> str:
        """Feed the full output ids so far; return the text added since the last call."""
        prefix = self.tok.decode(ids[self._prefix_offset:self._read_offset], self.skip)
        full = self.tok.decode(ids[self._prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.text += new
            # the last emitted tokens stay as context, so merges across boundaries decode right
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            return new
        return ""
