"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from serving.server.context import ServerContext, get_ctx
from serving.server.http_io import parse_body, sse_stream, unless_disconnected
from serving.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAISampling
from serving.server.req_handle import ReqState, merged_updates, run_all, submit_all
from serving.server.text import TextStream, final_text

router = APIRouter()
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def finish_fields(st: ReqState) -> dict[str, Any]:
    reason = st.finish_reason or {}
    kind = reason.get("type")
    return {
        "finish_reason": kind if kind in ("stop", "length", "abort") else None,
        "matched_stop": reason.get("matched") if kind == "stop" else None,
    }


def usage(states: list[ReqState]) -> dict[str, Any]:
    prompt = sum(s.prompt_tokens for s in states)
    completion = sum(len(s.output_ids) for s in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in states)},
    }


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    return {
        "object": "list",
        "data": [
            {
                "id": ctx.model_name,
                "object": "model",
                "created": int(ctx.client.started_at),
                "owned_by": "hicache",
                "root": ctx.info["model_path"],
                "max_model_len": ctx.context_len,
            }
        ],
    }


def _skip_special(body: OpenAISampling) -> bool:
    return True if body.skip_special_tokens is None else body.skip_special_tokens


def _stop(body: OpenAISampling) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


# -- chat -----------------------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await parse_body(request, ChatCompletionRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    model = ctx.check_model(body.model)
    # the chat template and the tokenizer run off the event loop: a huge prompt delays only itself
    ids = await run_in_threadpool(ctx.chat_ids, [msg.as_template_dict() for msg in body.messages])
    max_tokens = body.requested_max_tokens
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = ctx.default_max_tokens(len(ids))
    req = ctx.make_request(ids, body.sampling_params(max_tokens), body.session_id, param_name=name,
                           bootstrap=body.bootstrap(0, 1), cache_salt=body.cache_salt)
    head = {"id": f"chatcmpl-{req.rid}", "created": int(time.time()), "model": model}
    if not body.stream:
        [st] = await unless_disconnected(request, run_all(ctx.client, [req]))
        text = final_text(ctx.tokenizer, st.output_ids, st.finish_reason, _skip_special(body))
        return {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    **finish_fields(st),
                }
            ],
            "usage": usage([st]),
        }
    [handle] = await submit_all(ctx.client, [req])
    return StreamingResponse(
        sse_stream(_chat_chunks(ctx, body, handle, head)), media_type="text/event-stream"
    )


async def _chat_chunks(
    ctx: ServerContext, body: ChatCompletionRequest, handle: Any, head: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    text = TextStream(ctx.tokenizer, _stop(body), _skip_special(body))
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats

    def chunk(delta: dict[str, Any], st: ReqState, finish: dict[str, Any] | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        c = {**head, "object": "chat.completion.chunk", "choices": [{**choice, **(finish or {})}]}
        if continuous:
            c["usage"] = usage([st])
        return c

    try:
        yield chunk({"role": "assistant", "content": ""}, handle.state)
        async for st in handle.updates():
            delta = text.update(st)
            if delta:
                yield chunk({"content": delta}, st)
            if st.finished:
                yield chunk({}, st, finish_fields(st))
        if body.include_usage:
            yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage([handle.state])}
    finally:
        handle.close()


# -- completions ----------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await parse_body(request, CompletionRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    model = ctx.check_model(body.model)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    reqs = []
    for i, prompt in enumerate(body.prompt):
        ids = await run_in_threadpool(ctx.encode, prompt) if isinstance(prompt, str) else prompt
        reqs.append(
            ctx.make_request(ids, body.sampling_params(max_tokens), body.session_id, prompt_param="prompt",
                             bootstrap=body.bootstrap(i, len(body.prompt)), cache_salt=body.cache_salt)
        )
    head = {"id": f"cmpl-{reqs[0].rid}", "created": int(time.time()), "model": model}
    if not body.stream:
        states = await unless_disconnected(request, run_all(ctx.client, reqs))
        choices = [
            {
                "index": i,
                "text": final_text(ctx.tokenizer, st.output_ids, st.finish_reason, _skip_special(body)),
                "logprobs": None,
                **finish_fields(st),
            }
            for i, st in enumerate(states)
        ]
        return {**head, "object": "text_completion", "choices": choices, "usage": usage(states)}
    handles = await submit_all(ctx.client, reqs)
    return StreamingResponse(
        sse_stream(_completion_chunks(ctx, body, handles, head)), media_type="text/event-stream"
    )


async def _completion_chunks(
    ctx: ServerContext, body: CompletionRequest, handles: list[Any], head: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    texts = [TextStream(ctx.tokenizer, _stop(body), _skip_special(body)) for _ in handles]
    done = [False] * len(handles)
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
    async for i, st in merged_updates(handles):
        if done[i]:
            continue
        delta = texts[i].update(st)
        if not delta and not st.finished:
            continue
        done[i] = st.finished
        fin = finish_fields(st) if st.finished else {"finish_reason": None}
        c = {
            **head,
            "object": "text_completion",
            "choices": [{"index": i, "text": delta, "logprobs": None, **fin}],
        }
        if continuous:
            c["usage"] = usage([st])
        yield c
    if body.include_usage:
        yield {**head, "object": "text_completion", "choices": [], "usage": usage([h.state for h in handles])}
