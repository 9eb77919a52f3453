"""Logprobs in each API's shape, from a request's ``ReqState.logprobs`` (serving.runner.logprobs).

- SGLang ``meta_info``: serving.runner.logprob_meta (the offline Engine returns it too).
- OpenAI chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
- OpenAI completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; with
  ``echo`` the prompt's tokens come first (the first one's logprob is None).
"""

from __future__ import annotations

import functools
from typing import Any

from serving.runner.logprob_meta import token_text
from serving.tokenizer import Tokenizer

__all__ = ["chat_logprobs", "completion_logprobs", "token_bytes"]


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable stand-in character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(tok: Tokenizer | None, token_id: int) -> list[int]:
    """The token's raw bytes (OpenAI's ``bytes``): exact for byte-level BPE vocabularies, where a
    token may hold part of a UTF-8 character; else the UTF-8 of its text."""
    piece = tok.hf.convert_ids_to_tokens(token_id) if tok is not None else None
    dec = _byte_decoder()
    if isinstance(piece, str) and piece and all(c in dec for c in piece):
        return [dec[c] for c in piece]
    return list(token_text(tok, token_id).encode("utf-8"))


# -- OpenAI chat --------------------------------------------------------------------------------
def _chat_entry(tok: Tokenizer | None, pair: list[Any]) -> dict[str, Any]:
    text = token_text(tok, pair[1])
    return {"token": text, "logprob": pair[0], "bytes": token_bytes(tok, pair[1])}


def chat_logprobs(lp: dict[str, list[Any]], tok: Tokenizer | None, top: int, start: int = 0,
                  end: int | None = None) -> dict[str, Any]:
    """Output tokens ``start .. end`` as a chat choice's ``logprobs``."""
    out = lp.get("output", [])[start:end]
    tops = lp.get("output_top", [])[start:end] if top else [[] for _ in out]
    return {"content": [{**_chat_entry(tok, p), "top_logprobs": [_chat_entry(tok, t) for t in row or []]}
                        for p, row in zip(out, tops, strict=True)], "refusal": None}


# -- OpenAI completions ---------------------------------------------------------------------------
def completion_logprobs(lp: dict[str, list[Any]], tok: Tokenizer | None, top: int, echo: bool,
                        start: int = 0, end: int | None = None, text_offset: int = 0) -> dict[str, Any]:
    """Output tokens ``start .. end`` (and the prompt's first, with ``echo``) as a completion
    choice's ``logprobs``; ``text_offset`` is where their text starts in the choice's text."""
    pairs = lp.get("output", [])[start:end]
    tops = lp.get("output_top", [])[start:end] if top else [None] * len(pairs)
    if echo:
        pairs = lp.get("input", []) + pairs
        tops = (lp.get("input_top", []) if top else [None] * len(lp.get("input", []))) + tops
    tokens, offsets, at = [], [], text_offset
    for p in pairs:
        t = token_text(tok, p[1])
        tokens.append(t)
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [p[0] for p in pairs],
        "top_logprobs": [None if row is None else {token_text(tok, t[1]): t[0] for t in row} for row in tops]
        if top else None,
        "text_offset": offsets,
    }
