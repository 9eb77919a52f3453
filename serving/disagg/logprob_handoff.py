"""Logprobs across the PD transfer: what the prefill server computed travels in the KVDone.

The prefill server samples the first output token, so only it has that token's logits, and
only it computes the prompt: the first token's logprob (with its ``top_logprobs`` and
``token_ids_logprob`` entries) and the prompt (input) logprobs a request asks for
(``logprob_start_len``) exist there alone. :func:`export` takes them from the prefill side's
:class:`~serving.runner.logprobs.LogprobState` (on the scheduler thread, when the KV is sent);
:func:`check_wire` validates their JSON shape where the KVDone is parsed (a bad peer gets a
400); :func:`adopt` puts them into the decode side's state before it decodes from the first
token, so the answer carries the same numbers as a colocated server's. A decode request that
asks for logprobs fails (502, naming why) rather than answer numbers it did not get: the
prefill server sent none, or ones that do not fit the request's options.

Wire form (a JSON object; lists as ``LogprobState`` keeps them): ``input`` (pairs
``[logprob | null, token_id]``), ``input_top`` / ``input_ids`` (per prompt position a list of
pairs, or null), ``output`` (the first token's pair), ``output_top`` / ``output_ids``.
"""

from __future__ import annotations

from typing import Any

KEYS = ("input", "input_top", "input_ids", "output", "output_top", "output_ids")
ROWS = ("input_top", "input_ids", "output_top", "output_ids")  # per position: a list of pairs (or null)


def export(st: Any) -> dict[str, Any] | None:
    """The prefill side's logprobs for the decode side (None: the request asked for none)."""
    if st is None:
        return None
    return {"input": list(st.input), "input_top": list(st.input_top), "input_ids": list(st.input_ids),
            "output": st.output[:1], "output_top": st.output_top[:1], "output_ids": st.output_ids[:1]}


def _pair(p: Any, nullable: bool) -> bool:
    return (isinstance(p, list) and len(p) == 2 and isinstance(p[1], int) and not isinstance(p[1], bool)
            and ((nullable and p[0] is None) or (isinstance(p[0], int | float) and not isinstance(p[0], bool))))


def check_wire(d: Any) -> dict[str, Any] | None:
    """``d`` if it has the wire form (None stays None); ValueError naming what is wrong."""
    if d is None:
        return None
    if not isinstance(d, dict) or set(d) != set(KEYS) or not all(isinstance(d[k], list) for k in KEYS):
        raise ValueError(f"KVDone.logprobs: expected an object of lists {list(KEYS)}")
    if not all(_pair(p, nullable=True) for p in d["input"]) or not all(_pair(p, False) for p in d["output"]):
        raise ValueError("KVDone.logprobs: input / output must be [logprob, token_id] pairs")
    for k in ROWS:
        if not all(row is None or (isinstance(row, list) and all(_pair(p, False) for p in row)) for row in d[k]):
            raise ValueError(f"KVDone.logprobs: {k} must be lists of [logprob, token_id] pairs")
    return d


def adopt(st: Any, d: dict[str, Any] | None, first_token: int) -> str | None:
    """Put the prefill side's logprobs into the decode side's state ``st``; the reason when
    they cannot be used (``st`` is then unchanged)."""
    if st is None:
        return None
    if d is None:
        return ("the prefill server sent no logprobs for this request (is it an older version?); "
                "logprobs are not available through this pair")
    n_in = st.prompt_len - st.start
    want = {"input": n_in, "input_top": n_in if st.top else 0, "input_ids": n_in if st.token_ids else 0,
            "output": 1, "output_top": 1 if st.top else 0, "output_ids": 1 if st.token_ids else 0}
    wrong = [k for k in KEYS if len(d[k]) != want[k]]
    if wrong or d["output"][0][1] != first_token:
        return f"the prefill server's logprobs do not fit this request ({', '.join(wrong) or 'output'} differ)"
    if st.top and any(len(row) != st.top for row in d["output_top"]):
        return "the prefill server's logprobs have another top_logprobs_num"
    if st.token_ids and any(row is not None and [p[1] for p in row] != list(st.token_ids)
                            for row in d["input_ids"] + d["output_ids"]):
        return "the prefill server's logprobs name other token_ids_logprob"
    for k in KEYS:
        getattr(st, k)[:] = d[k]
    return None
