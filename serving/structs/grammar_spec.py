"""What a request asks its output to match: ``(kind, text)`` from SGLang sampling params
(``json_schema`` / ``regex`` / ``ebnf``, at most one) or from OpenAI's ``response_format``."""

from __future__ import annotations

import json
from typing import Any

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format {"type": "json_object"}: any JSON object


def grammar_spec(params: Any) -> tuple[str, str] | None:
    """The ``(kind, text)`` of a SamplingParams (or None when unconstrained)."""
    for kind in GRAMMAR_KINDS:
        text = getattr(params, kind, None)
        if text is not None:
            return kind, text
    return None


def normalize_grammar_params(d: dict[str, Any]) -> str | None:
    """Check the grammar keys of a sampling-params dict in place (a ``json_schema`` given as a
    dict becomes its JSON text); returns an error message or None."""
    given = [k for k in GRAMMAR_KINDS if d.get(k) is not None]
    if len(given) > 1:
        return f"give at most one of json_schema, regex, ebnf (got {', '.join(given)})"
    if not given:
        return None
    kind = given[0]
    value = d[kind]
    if kind == "json_schema" and isinstance(value, dict | bool):
        try:
            d[kind] = value = json.dumps(value)
        except RecursionError:
            return "json_schema is nested too deeply"
        except (TypeError, ValueError) as e:
            return f"json_schema is not valid JSON: {e}"
    if not isinstance(value, str) or not value.strip():
        what = "a JSON schema (a string or an object)" if kind == "json_schema" else "a non-empty string"
        return f"{kind} must be {what}"
    return None


def response_format_params(response_format: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI ``response_format`` -> SGLang sampling params; ValueError names the problem."""
    if response_format is None:
        return {}
    kind = response_format.get("type")
    extra = sorted(set(response_format) - {"type", "json_schema"})
    if extra:
        raise ValueError(f"response_format: unknown field(s) {', '.join(extra)}")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError('response_format: type "json_schema" needs a "json_schema" object')
        unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
        if unknown:
            raise ValueError(f"response_format.json_schema: unknown field(s) {', '.join(unknown)}")
        schema = spec.get("schema")
        if schema is None:
            return {"json_schema": JSON_OBJECT_SCHEMA}
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return {"json_schema": json.dumps(schema)}
    raise ValueError(f'response_format: type must be "text", "json_object" or "json_schema", got {kind!r}')
