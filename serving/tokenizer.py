"""Tokenizer access (HF ``tokenizer.json`` folders) and incremental detokenization."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from serving.sampling_params import InvalidRequest


def has_tokenizer(path: str) -> bool:
    return os.path.exists(os.path.join(path, "tokenizer.json")) or os.path.exists(
        os.path.join(path, "tokenizer_config.json"))


class Tokenizer:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.path = path

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise InvalidRequest("this model has no chat template; use /v1/completions or /generate")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)


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
