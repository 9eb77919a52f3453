"""``tool_choice`` ``required`` / a named function as constrained decoding: an xgrammar structural
tag (serving/grammar) whose tags are the parser's own call text (``ToolParser.structure``) around
each tool's ``parameters`` schema, so what the model writes parses as calls whose arguments
validate against their schemas. ``required``: one or more calls (one without parallel calls);
a named function: one call to it."""

from __future__ import annotations

import json
from typing import Any

from serving.parsing.tool_base import ToolParser

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _tag(parser: ToolParser, tool: dict[str, Any]) -> dict[str, Any]:
    s = parser.structure(tool["name"])
    schema = tool.get("parameters") or ANY_OBJECT
    # at most one whitespace character in a row: a small model otherwise pads the JSON with runs of it
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    return {"type": "tag", "begin": s.begin, "content": content, "end": s.end}


def forced_calls(parser: ToolParser, tools: list[dict[str, Any]], name: str | None, parallel: bool) -> str:
    """The structural tag (JSON text) for ``tools`` (function definitions: name, parameters):
    calls to ``name`` only when given (then one call), else at least one of any."""
    chosen = [t for t in tools if name is None or t["name"] == name]
    fmt = {"type": "tags_with_separator", "tags": [_tag(parser, t) for t in chosen], "separator": parser.separator,
           "at_least_one": True, "stop_after_first": name is not None or not parallel}
    return json.dumps({"type": "structural_tag", "format": fmt})
