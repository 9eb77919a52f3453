"""Anthropic's Messages API: POST /v1/messages (+ /v1/messages/count_tokens).

The same engine path as chat completions: ``system`` and ``messages`` go through the chat
template; ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``max_tokens`` map onto
SGLang sampling params; HiCache's ``session_id`` is accepted as on the other routes. ``tools``
and ``tool_use`` / ``tool_result`` blocks are rendered as text (serving/server/anthropic_tools.py);
the answer is one text block, or, with ``--tool-call-parser`` / ``--reasoning-parser``,
``thinking``, ``text`` and ``tool_use`` blocks (serving/server/anthropic_blocks.py).
Usage follows Anthropic: ``cache_control`` breakpoints pin
prefixes, best-effort (serving/server/cache_control.py; /v1/messages/count_tokens checks them
the same way); ``cache_read_input_tokens`` are the prompt tokens served from the cache (any tier),
``cache_creation_input_tokens`` those written into newly pinned prefixes, ``input_tokens`` the
rest (the three sum to the prompt). Streaming sends Anthropic's events
(``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``,
``content_block_stop``, ``message_delta``, ``message_stop``). Errors have Anthropic's shape
``{"type": "error", "error": {"type", "message"}}``, mid-stream as an ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, model_validator
from starlette.concurrency import run_in_threadpool

from common.prompt_form import anthropic_chat
from serving.compat_fields import ANY
from serving.server import cache_control
from serving.server.anthropic_blocks import Shapes, content_blocks, parsed_events
from serving.server.anthropic_tools import Block, TextBlock, Tool, anthropic_tool_request, check_roles
from serving.server.chat_output import ToolRequest, answer_params, output_parser, strip_eos
from serving.server.context import ServerContext, get_ctx
from serving.server.errors import APIError
from serving.server.http_io import parse_body, unless_disconnected
from serving.server.protocol import StrictModel
from serving.server.req_handle import ReqHandle, ReqState, run_all, submit_all
from serving.server.text import TextStream, final_text

router = APIRouter()

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                504: "timeout_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_errors(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @wraps(fn)
    async def wrapper(request: Request) -> Any:
        try:
            return await fn(request)
        except APIError as e:
            return JSONResponse(error_body(e.status, e.message), status_code=e.status)

    return wrapper


Content = str | list[TextBlock]


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


def _check_messages(messages: list[Message]) -> None:
    for j, msg in enumerate(messages):
        if not isinstance(msg.content, str):
            check_roles(msg.role, msg.content, f"messages[{j}]")


class MessagesRequest(StrictModel):
    # thinking: with --reasoning-parser the reasoning comes back as thinking blocks
    neutral_fields = {"thinking": ANY, "service_tier": ("auto", "standard_only"),
                      "container": (), "mcp_servers": ((), []), "output_config": ({},), "speed": ("standard",),
                      "diagnostics": ANY, "inference_geo": ANY, "user_profile_id": ANY,
                      "workspace_id": ANY}

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)]
    system: Content | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # user_id: accepted, cannot change the answer
    session_id: str | None = None  # HiCache's session (as on the other routes)
    cache_control: dict[str, Any] | None = None  # automatic caching: a breakpoint on the last message
    tools: list[Tool] | None = None  # rendered before the system text (serving/server/anthropic_tools.py)
    tool_choice: dict[str, Any] | None = None  # auto | any | tool (name) | none; disable_parallel_tool_use

    @model_validator(mode="after")
    def _checks(self) -> MessagesRequest:
        if self.stop_sequences is not None and not all(self.stop_sequences):
            raise ValueError("stop_sequences: must be non-empty strings")
        _check_messages(self.messages)
        self.tool_request()  # validates tool_choice
        return self

    def tool_request(self) -> ToolRequest:
        return anthropic_tool_request(self.tools, self.tool_choice)

    def template_messages(self) -> list[dict[str, Any]]:
        system = self.system if isinstance(self.system, str) or self.system is None else [
            b.model_dump() for b in self.system]
        return anthropic_chat(system, [m.model_dump() for m in self.messages],
                              [t.model_dump() for t in self.tools or []])

    def sampling_params(self) -> dict[str, Any]:
        p = {"max_new_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
             "top_k": self.top_k, "stop": self.stop_sequences}
        return {k: v for k, v in p.items() if v is not None}


class CountTokensRequest(StrictModel):
    neutral_fields = {"tool_choice": ANY, "thinking": ANY}  # neither changes a count
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Content | None = None
    tools: list[Tool] | None = None
    cache_control: dict[str, Any] | None = None  # checked as /v1/messages checks it; changes no count

    @model_validator(mode="after")
    def _checks(self) -> CountTokensRequest:
        _check_messages(self.messages)
        return self

    template_messages = MessagesRequest.template_messages


def stop_fields(st: ReqState) -> dict[str, Any]:
    reason = st.finish_reason or {}
    if reason.get("type") == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
        return {"stop_reason": "stop_sequence", "stop_sequence": reason["matched"]}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def usage(st: ReqState, pins: dict[str, Any] | None = None) -> dict[str, Any]:
    return cache_control.anthropic_usage(st, pins)


@router.post("/v1/messages/count_tokens")
@anthropic_errors
async def count_tokens(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await parse_body(request, CountTokensRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    ctx.check_model(body.model)
    cache_control.anthropic_points(body)  # the breakpoints' 400s, the same as /v1/messages'
    ids = await run_in_threadpool(ctx.chat_ids, body.template_messages())
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
@anthropic_errors
async def messages(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await parse_body(request, MessagesRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    model = ctx.check_model(body.model)
    ids = await run_in_threadpool(ctx.chat_ids, body.template_messages())
    tools = body.tool_request()
    parser = output_parser(ctx, tools, True, ids)
    params = answer_params(ctx, parser, tools, body.sampling_params())
    req = ctx.make_request(ids, params, body.session_id)
    bps = await cache_control.breakpoints_for(ctx, body, ids)
    req.capture_at = [b.end for b in bps] or None  # a state model keeps its state there
    head = {"id": f"msg_{req.rid}", "type": "message", "role": "assistant", "model": model}
    if not body.stream:
        [st] = await unless_disconnected(request, run_all(ctx.client, [req]))
        pins = await cache_control.apply(ctx, ids, bps, st)
        text = final_text(ctx.tokenizer, st.output_ids, st.finish_reason, not parser.keeps_special_tokens)
        if not parser.active:
            return {**head, "content": [{"type": "text", "text": text}], **stop_fields(st), "usage": usage(st, pins)}
        blocks = content_blocks(parser.parse(strip_eos(ctx, parser, text)))
        stop = stop_fields(st)
        if any(b["type"] == "tool_use" for b in blocks) and stop["stop_reason"] == "end_turn":
            stop["stop_reason"] = "tool_use"
        return {**head, "content": blocks, **stop, "usage": usage(st, pins)}
    [handle] = await submit_all(ctx.client, [req])
    if parser.active:
        shapes = Shapes(stop_fields, error_body, usage)
        return StreamingResponse(parsed_events(ctx, parser, body.stop_sequences or [], handle, head, (ids, bps),
                                               shapes), media_type="text/event-stream")
    return StreamingResponse(_events(ctx, body, handle, head, (ids, bps)), media_type="text/event-stream")


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n"


async def _events(ctx: ServerContext, body: MessagesRequest, handle: ReqHandle, head: dict[str, Any],
                  prompt: tuple[list[int], list[cache_control.Breakpoint]]) -> AsyncIterator[str]:
    text = TextStream(ctx.tokenizer, body.stop_sequences or [])
    try:
        st = handle.state
        yield _event("message_start", {"message": {**head, "content": [], "stop_reason": None,
                                                   "stop_sequence": None, "usage": usage(st)}})
        yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        yield _event("ping", {})
        async for st in handle.updates():
            delta = text.update(st)
            if delta:
                yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": delta}})
        yield _event("content_block_stop", {"index": 0})
        pins = await cache_control.apply(ctx, *prompt, st)
        yield _event("message_delta", {"delta": stop_fields(st), "usage": usage(st, pins)})
        yield _event("message_stop", {})
    except APIError as e:
        yield _event("error", {"error": error_body(e.status, e.message)["error"]})
    finally:
        handle.close()
