"""The public calls, spelled as in SGLang's frontend language: ``gen``, ``select``, the roles."""

from __future__ import annotations

import json
from typing import Any

from serving.lang import ir


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
        dtype: type | None = None, choices: list[str] | None = None, choices_method: Any = None,
        regex: str | None = None, json_schema: str | dict | None = None) -> ir.Expr:
    """Generate text into variable ``name`` (``choices``: a :func:`select`)."""
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method)
    if dtype not in (None, str, int, float):
        raise TypeError("dtype must be str, int or float")
    if regex is not None and json_schema is not None:
        raise ValueError("give at most one of regex and json_schema")
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    params = {"max_new_tokens": max_tokens, "min_new_tokens": min_tokens, "stop": stop,
              "stop_token_ids": stop_token_ids, "temperature": temperature, "top_p": top_p, "top_k": top_k,
              "min_p": min_p, "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
              "ignore_eos": ignore_eos, "regex": regex, "json_schema": json_schema}
    return ir.Gen(name, {k: v for k, v in params.items() if v is not None}, bool(return_logprob),
                  logprob_start_len, top_logprobs_num, bool(return_text_in_logprobs), dtype)


def gen_int(name: str | None = None, **kwargs: Any) -> ir.Expr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> ir.Expr:
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: Any = None) -> ir.Expr:
    """Append the choice whose tokens the model finds most likely after the text so far
    (``choices_method``: ``token_length_normalized`` (default), ``unconditional_likelihood_normalized``,
    ``sum_logprob``, or a :class:`serving.lang.choices.ChoicesMethod`)."""
    if not isinstance(choices, list) or not choices:
        raise ValueError("select needs a non-empty list of choices")
    from serving.lang import choices as cm

    cm.resolve(choices_method)  # an unknown method fails here, in the program's line
    return ir.Select(name, list(choices), temperature, choices_method)


def system(expr: Any = None) -> ir.Expr:
    return ir.role("system", expr)


def user(expr: Any = None) -> ir.Expr:
    return ir.role("user", expr)


def assistant(expr: Any = None) -> ir.Expr:
    return ir.role("assistant", expr)


def system_begin() -> ir.Expr:
    return ir.RoleBegin("system")


def system_end() -> ir.Expr:
    return ir.RoleEnd("system")


def user_begin() -> ir.Expr:
    return ir.RoleBegin("user")


def user_end() -> ir.Expr:
    return ir.RoleEnd("user")


def assistant_begin() -> ir.Expr:
    return ir.RoleBegin("assistant")


def assistant_end() -> ir.Expr:
    return ir.RoleEnd("assistant")
