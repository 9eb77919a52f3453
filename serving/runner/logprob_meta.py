"""Logprobs options and SGLang's ``meta_info`` shape, shared by the offline Engine and the HTTP
server (serving.server.logprob_format builds the OpenAI shapes on top).

SGLang ``meta_info``: ``input_token_logprobs`` / ``output_token_logprobs`` as
``[logprob, token_id, text | None]`` (the first prompt token's logprob is None), plus
``*_top_logprobs`` (with ``top_logprobs_num``) and ``*_token_ids_logprobs`` (with
``token_ids_logprob``), per position a list of such triples.
"""

from __future__ import annotations

from typing import Any

from serving.structs.logprob_options import LogprobOptions
from serving.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs (here, torch-free: the HTTP side validates with it)


def token_text(tok: Tokenizer | None, token_id: int | None) -> str:
    if tok is None or token_id is None:
        return ""
    return tok.decode([token_id], False)


def sglang_meta(lp: dict[str, list[Any]], opts: LogprobOptions, tok: Tokenizer | None, with_text: bool
                ) -> dict[str, Any]:
    def triple(pair: list[Any]) -> list[Any]:
        return [pair[0], pair[1], token_text(tok, pair[1]) if with_text else None]

    def triples(rows: list[Any]) -> list[Any]:
        return [None if row is None else [triple(p) for p in row] for row in rows]

    out: dict[str, Any] = {
        "input_token_logprobs": [triple(p) for p in lp.get("input", [])],
        "output_token_logprobs": [triple(p) for p in lp.get("output", [])],
    }
    if opts.top:
        out["input_top_logprobs"] = triples(lp.get("input_top", []))
        out["output_top_logprobs"] = triples(lp.get("output_top", []))
    if opts.token_ids is not None:
        out["input_token_ids_logprobs"] = triples(lp.get("input_ids", []))
        out["output_token_ids_logprobs"] = triples(lp.get("output_ids", []))
    return out
