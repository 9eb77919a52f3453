"""What a request asks its output to match: ``(kind, text)`` from SGLang sampling params
(``json_schema`` / ``regex`` / ``ebnf`` / ``structural_tag``, at most one) or from OpenAI's
``response_format``. A structural tag is xgrammar's (``{"type": "structural_tag", "format": ...}``);
SGLang's older form (``structures`` of begin / schema / end, and ``triggers``) becomes that."""

from __future__ import annotations

import json
from typing import Any

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
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
        return f"give at most one of json_schema, regex, ebnf, structural_tag (got {', '.join(given)})"
    if not given:
        return None
    kind = given[0]
    value = d[kind]
    if kind in ("json_schema", "structural_tag") and isinstance(value, dict | bool):
        try:
            d[kind] = value = json.dumps(value)
        except RecursionError:
            return f"{kind} is nested too deeply"
        except (TypeError, ValueError) as e:
            return f"{kind} is not valid JSON: {e}"
    if not isinstance(value, str) or not value.strip():
        what = {"json_schema": "a JSON schema (a string or an object)",
                "structural_tag": "a structural tag (a string or an object)"}.get(kind, "a non-empty string")
        return f"{kind} must be {what}"
    return None


def response_format_params(response_format: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI ``response_format`` -> SGLang sampling params; ValueError names the problem."""
    if response_format is None:
        return {}
    kind = response_format.get("type")
    if kind == "structural_tag":
        return {"structural_tag": structural_tag(response_format)}
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
    raise ValueError(f'response_format: type must be "text", "json_object", "json_schema" or "structural_tag", '
                     f"got {kind!r}")


def structural_tag(spec: dict[str, Any]) -> str:
    """``response_format`` of type ``structural_tag`` as xgrammar's structural tag (JSON text):
    its ``format`` as given, or SGLang's older ``structures`` + ``triggers`` as triggered tags."""
    if "format" in spec:
        extra = sorted(set(spec) - {"type", "format"})
        if extra:
            raise ValueError(f"response_format: unknown field(s) {', '.join(extra)} beside format")
        if not isinstance(spec["format"], dict):
            raise ValueError("response_format.format must be an object")
        return json.dumps({"type": "structural_tag", "format": spec["format"]})
    extra = sorted(set(spec) - {"type", "structures", "triggers"})
    if extra:
        raise ValueError(f"response_format: unknown field(s) {', '.join(extra)}")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError('response_format: type "structural_tag" needs "format", or "structures" (a non-empty list)')
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("response_format.triggers: must be a non-empty list of non-empty strings")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or set(s) - {"begin", "schema", "end"} or not isinstance(s.get("begin"), str) \
                or not isinstance(s.get("end"), str) or not isinstance(s.get("schema"), dict | bool):
            raise ValueError(f"response_format.structures[{i}]: must be {{begin: str, schema: object, end: str}}")
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": s["schema"]}})
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}})
