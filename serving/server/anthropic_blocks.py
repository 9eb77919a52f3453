"""Anthropic's content blocks for a parsed answer (``--tool-call-parser`` / ``--reasoning-parser``):
``thinking`` (the reasoning), ``text`` and ``tool_use`` blocks in the answer's order, whole or
streamed (``content_block_start`` / ``_delta`` / ``_stop``: ``thinking_delta``, ``text_delta``,
``input_json_delta`` with each call's whole input). ``stop_reason`` is ``tool_use`` when a call
was made and the answer ended on its own. One stream per request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from serving.parsing.output import Output, OutputParser, OutputStream, Piece
from serving.server import cache_control
from serving.server.chat_output import call_id, strip_eos
from serving.server.context import ServerContext
from serving.server.errors import APIError
from serving.server.req_handle import ReqHandle, ReqState
from serving.server.text import TextStream


def _use(piece_call: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id("toolu_"), "name": piece_call.name, "input": piece_call.input}


def content_blocks(out: Output) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    for item in out.items:
        if isinstance(item, str):
            if item.strip():
                blocks.append({"type": "text", "text": item})
        else:
            blocks.append(_use(item))
    return blocks or [{"type": "text", "text": ""}]


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class Shapes:
    """The route's own answer shapes (serving/server/anthropic_api.py owns them)."""

    stop_fields: Callable[[ReqState], dict[str, Any]]
    error_body: Callable[[int, str], dict[str, Any]]
    usage: Callable[..., dict[str, Any]]


def _stop(shapes: Shapes, st: ReqState, used: bool) -> dict[str, Any]:
    stop = shapes.stop_fields(st)
    if used and stop["stop_reason"] == "end_turn":
        stop["stop_reason"] = "tool_use"
    return stop


class _Blocks:
    """The open block and the next index."""

    def __init__(self) -> None:
        self.index, self.open = -1, None  # type: tuple[int, str | None]
        self.used = False

    def to(self, kind: str, start: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        return [*out, _event("content_block_start", {"index": self.index, "content_block": start})]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def piece(self, p: Piece) -> list[str]:
        out: list[str] = []
        if p.kind == "reasoning":
            if self.open != "thinking":
                out += self.to("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(_event("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "thinking_delta", "thinking": p.text}}))
        elif p.kind == "content":
            if self.open != "text":
                out += self.to("text", {"type": "text", "text": ""})
            out.append(_event("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "text_delta", "text": p.text}}))
        elif p.call is not None:
            self.used = True
            out += self.to("tool_use", {**_use(p.call), "input": {}})
            out.append(_event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": p.call.arguments}}))
            out += self.close()
        return out


async def parsed_events(ctx: ServerContext, parser: OutputParser, stop: list[str], handle: ReqHandle,
                        head: dict[str, Any], prompt: tuple[list[int], list[cache_control.Breakpoint]],
                        shapes: Shapes) -> AsyncIterator[str]:
    usage = shapes.usage
    text = TextStream(ctx.tokenizer, stop, not parser.keeps_special_tokens)
    out, blocks = OutputStream(parser), _Blocks()
    try:
        st = handle.state
        yield _event("message_start", {"message": {**head, "content": [], "stop_reason": None,
                                                   "stop_sequence": None, "usage": usage(st)}})
        yield _event("ping", {})
        async for st in handle.updates():
            if text.update(st) or st.finished:
                whole = strip_eos(ctx, parser, text.text) if st.finished else text.text
                for p in out.update(whole, st.finished):
                    for e in blocks.piece(p):
                        yield e
        if blocks.index < 0:
            for e in blocks.to("text", {"type": "text", "text": ""}):
                yield e
        for e in blocks.close():
            yield e
        pins = await cache_control.apply(ctx, *prompt, st)
        yield _event("message_delta", {"delta": _stop(shapes, st, blocks.used), "usage": usage(st, pins)})
        yield _event("message_stop", {})
    except APIError as e:
        yield _event("error", {"error": shapes.error_body(e.status, e.message)["error"]})
    finally:
        handle.close()
