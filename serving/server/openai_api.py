"""OpenAI-compatible routes: /v1/models (+ /v1/models/{model}), /v1/chat/completions, /v1/completions.

``n > 1``: the prompt is computed once (serving.server.fanout) and each choice decodes from its
KV; usage counts the prompt once. Logprobs: chat ``logprobs`` / ``top_logprobs``, completions
``logprobs`` (+ ``echo``: the prompt's text and logprobs first), streamed per chunk too.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from serving import ipc as m
from serving.parsing.output import OutputParser, OutputStream, Piece
from serving.server import cache_control
from serving.server.chat_output import answer_params, call_id, output_parser, strip_eos
from serving.server.context import ServerContext, get_ctx
from serving.server.errors import APIError
from serving.server.fanout import check_n, choices, scoring, trim_scoring, warm_prefix
from serving.server.http_io import parse_body, sse_stream, unless_disconnected
from serving.server.logprob_format import chat_logprobs, completion_logprobs
from serving.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAISampling
from serving.server.req_handle import ReqState, merged_updates, run_all, submit_all
from serving.server.text import TextStream, final_text
from serving.structs.logprob_options import LogprobOptions

router = APIRouter()
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def finish_fields(st: ReqState) -> dict[str, Any]:
    reason = st.finish_reason or {}
    kind = reason.get("type")
    return {
        "finish_reason": kind if kind in ("stop", "length", "abort") else None,
        "matched_stop": reason.get("matched") if kind == "stop" else None,
    }


def usage(states: list[ReqState], prompts: list[ReqState] | None = None) -> dict[str, Any]:
    """Completion tokens of every choice; prompt (and cached) tokens of ``prompts``, one state per
    prompt (default: every state's, for n = 1)."""
    prompts = states if prompts is None else prompts
    prompt = sum(s.prompt_tokens for s in prompts)
    completion = sum(len(s.output_ids) for s in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in prompts)},
    }


def model_card(ctx: ServerContext) -> dict[str, Any]:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": int(ctx.client.started_at),
        "owned_by": "hicache",
        "root": ctx.info["model_path"],
        "max_model_len": ctx.context_len,
    }


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(get_ctx(request))]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> dict[str, Any]:
    """OpenAI's retrieve-model: the served model by any name a request's ``model`` may give
    (the model path too, slashes and all); else a 404 with ``model_not_found``."""
    ctx = get_ctx(request)
    ctx.check_model(model)
    return model_card(ctx)


def _skip_special(body: OpenAISampling) -> bool:
    return True if body.skip_special_tokens is None else body.skip_special_tokens


def _stop(body: OpenAISampling) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


async def _fan_out(request: Request, ctx: ServerContext, reqs: list[m.GenerateReq], n: int
                   ) -> tuple[list[m.GenerateReq], list[ReqState] | None]:
    """Each request as ``n`` choices sharing one prefill; the warm-up states (one per prompt) or None."""
    if n == 1:
        return reqs, None
    warm = await unless_disconnected(request, warm_prefix(ctx.client, reqs))
    return [c for r in reqs for c in choices(r, n)], warm


# -- chat -----------------------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await parse_body(request, ChatCompletionRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    model = ctx.check_model(body.model)
    n = check_n(body.n)
    # the chat template and the tokenizer run off the event loop: a huge prompt delays only itself
    ids = await run_in_threadpool(ctx.chat_ids, body.template_messages(), body.chat_template_kwargs)
    tools = body.tool_request()
    parser = output_parser(ctx, tools, body.separate_reasoning, ids)
    max_tokens = body.requested_max_tokens
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if max_tokens is None:
        max_tokens = ctx.default_max_tokens(len(ids))
    top = body.top_logprobs or 0
    opts = LogprobOptions(None, top) if body.logprobs else None
    params = answer_params(ctx, parser, tools, body.sampling_params(max_tokens))
    req = ctx.make_request(ids, params, body.session_id, param_name=name,
                           bootstrap=body.bootstrap(0, 1), cache_salt=body.cache_salt,
                           logprobs=opts)
    head = {"id": f"chatcmpl-{req.rid}", "created": int(time.time()), "model": model}
    bps = cache_control.whole_prompt(body.cache_control, ids)
    if bps and n > 1:
        raise APIError(400, "cache_control: needs n = 1", param="cache_control")
    reqs, warm = await _fan_out(request, ctx, [req], n)
    if not body.stream:
        states = await unless_disconnected(request, run_all(ctx.client, reqs))
        pins = await cache_control.apply(ctx, ids, bps, states[0], body.cache_salt) if bps else None
        return {
            **({"meta_info": {"cache_control": cache_control.meta(states[0], pins)}} if pins else {}),
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": i,
                    **_message(ctx, parser, st, _skip_special(body) and not parser.keeps_special_tokens),
                    "logprobs": chat_logprobs(st.logprobs, ctx.tokenizer, top) if opts else None,
                }
                for i, st in enumerate(states)
            ],
            "usage": usage(states, warm),
        }
    handles = await submit_all(ctx.client, reqs)
    return StreamingResponse(
        sse_stream(_chat_chunks(ctx, body, handles, head, warm, opts, parser, (ids, bps) if bps else None)),
        media_type="text/event-stream"
    )


async def _chat_chunks(
    ctx: ServerContext, body: ChatCompletionRequest, handles: list[Any], head: dict[str, Any],
    warm: list[ReqState] | None, opts: LogprobOptions | None, parser: OutputParser,
    pin: tuple[list[int], list[cache_control.Breakpoint]] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """The chunks; with ``pin`` (``cache_control``, n = 1) the prompt is pinned once the request
    finished and the chunk with the finish_reason carries ``meta_info.cache_control``. With a
    parser, reasoning comes as ``delta.reasoning_content`` and each call as ``delta.tool_calls``
    (index, id and name, then its arguments)."""
    skip = _skip_special(body) and not parser.keeps_special_tokens
    texts = [TextStream(ctx.tokenizer, _stop(body), skip) for _ in handles]
    outs = [OutputStream(parser) for _ in handles]
    sent_lp = [0] * len(handles)
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats

    def chunk(i: int, delta: dict[str, Any], st: ReqState, finish: dict[str, Any] | None = None) -> dict[str, Any]:
        lp = None
        if opts is not None and len(st.output_ids) > sent_lp[i]:
            lp = chat_logprobs(st.logprobs, ctx.tokenizer, opts.top, sent_lp[i], len(st.output_ids))
            sent_lp[i] = len(st.output_ids)
        choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": None}
        c = {**head, "object": "chat.completion.chunk", "choices": [{**choice, **(finish or {})}]}
        if continuous:
            c["usage"] = usage([st], None if warm is None else warm)
        return c

    for i, h in enumerate(handles):
        yield chunk(i, {"role": "assistant", "content": ""}, h.state)
    async for i, st in merged_updates(handles):
        delta = texts[i].update(st)
        if not parser.active:
            if delta:
                yield chunk(i, {"content": delta}, st)
        elif delta or st.finished:
            text = strip_eos(ctx, parser, texts[i].text) if st.finished else texts[i].text
            for d in _deltas(outs[i].update(text, st.finished)):
                yield chunk(i, d, st)
        if st.finished:
            fin = finish_fields(st)
            if outs[i].sent_calls and fin["finish_reason"] == "stop":
                fin["finish_reason"] = "tool_calls"
            last = chunk(i, {}, st, fin)
            if pin is not None:
                pins = await cache_control.apply(ctx, pin[0], pin[1], st, body.cache_salt)
                last["meta_info"] = {"cache_control": cache_control.meta(st, pins)}
            yield last
    if body.include_usage:
        yield {**head, "object": "chat.completion.chunk", "choices": [],
               "usage": usage([h.state for h in handles], warm)}


def _message(ctx: ServerContext, parser: OutputParser, st: ReqState, skip: bool) -> dict[str, Any]:
    """A finished choice's ``message`` and finish fields, reasoning and calls parsed out."""
    text = final_text(ctx.tokenizer, st.output_ids, st.finish_reason, skip)
    fin = finish_fields(st)
    if not parser.active:
        return {"message": {"role": "assistant", "content": text}, **fin}
    out = parser.parse(strip_eos(ctx, parser, text))
    msg: dict[str, Any] = {"role": "assistant", "content": out.content}
    if parser.reasoning is not None:
        msg["reasoning_content"] = out.reasoning or None
    if out.calls:
        msg["tool_calls"] = [{"id": call_id(), "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in out.calls]
        msg["content"] = out.content if out.content.strip() else None
        if fin["finish_reason"] == "stop":
            fin["finish_reason"] = "tool_calls"
    return {"message": msg, **fin}


def _deltas(pieces: list[Piece]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in pieces:
        if p.kind == "reasoning":
            out.append({"reasoning_content": p.text})
        elif p.kind == "content":
            out.append({"content": p.text})
        elif p.call is not None:
            out.append({"tool_calls": [{"index": p.index, "id": call_id(), "type": "function",
                                        "function": {"name": p.call.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": p.index, "function": {"arguments": p.call.arguments}}]})
    return out


# -- completions ----------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await parse_body(request, CompletionRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    model = ctx.check_model(body.model)
    n = check_n(body.n)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    opts = LogprobOptions(0 if body.echo else None, body.logprobs) if body.logprobs is not None else None
    params = body.sampling_params(max_tokens)
    score = scoring(params, opts is not None and body.echo)
    if score:
        params["max_new_tokens"] = 1  # a prefill: the one token is dropped (serving.server.fanout)
    reqs, prompt_ids = [], []
    for i, prompt in enumerate(body.prompt):
        ids = await run_in_threadpool(ctx.prompt_ids, prompt) if isinstance(prompt, str) else prompt
        prompt_ids.append(ids)
        reqs.append(
            ctx.make_request(ids, params, body.session_id, prompt_param="prompt",
                             bootstrap=body.bootstrap(i, len(body.prompt)), cache_salt=body.cache_salt,
                             logprobs=opts)
        )
    head = {"id": f"cmpl-{reqs[0].rid}", "created": int(time.time()), "model": model}
    reqs, warm = await _fan_out(request, ctx, reqs, n)
    echoes = [_echo_text(ctx, body, p) for p in prompt_ids for _ in range(n)]
    if not body.stream:
        states = await unless_disconnected(request, run_all(ctx.client, reqs))
        states = [trim_scoring(st) for st in states] if score else states
        out = []
        for i, st in enumerate(states):
            text = final_text(ctx.tokenizer, st.output_ids, st.finish_reason, _skip_special(body))
            lp = completion_logprobs(st.logprobs, ctx.tokenizer, opts.top, body.echo) if opts else None
            out.append({"index": i, "text": echoes[i] + text, "logprobs": lp, **finish_fields(st)})
        return {**head, "object": "text_completion", "choices": out, "usage": usage(states, warm)}
    handles = await submit_all(ctx.client, reqs)
    return StreamingResponse(
        sse_stream(_completion_chunks(ctx, body, handles, head, warm, opts, echoes, score)),
        media_type="text/event-stream",
    )


def _echo_text(ctx: ServerContext, body: CompletionRequest, prompt: str | list[int]) -> str:
    if not body.echo:
        return ""
    return prompt if isinstance(prompt, str) else final_text(ctx.tokenizer, prompt, None, _skip_special(body))


async def _completion_chunks(
    ctx: ServerContext, body: CompletionRequest, handles: list[Any], head: dict[str, Any],
    warm: list[ReqState] | None, opts: LogprobOptions | None, echoes: list[str], score: bool,
) -> AsyncIterator[dict[str, Any]]:
    texts = [TextStream(ctx.tokenizer, _stop(body), _skip_special(body)) for _ in handles]
    done = [False] * len(handles)
    sent_lp = [0] * len(handles)
    first = [True] * len(handles)
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
    async for i, st in merged_updates(handles):
        if done[i] or (score and not st.finished):
            continue
        st = trim_scoring(st) if score else st
        delta = texts[i].update(st)
        if not delta and not st.finished and not first[i]:
            continue
        echo = body.echo and first[i]
        lp = None
        if opts is not None:
            lp = completion_logprobs(st.logprobs, ctx.tokenizer, opts.top, echo, sent_lp[i], len(st.output_ids))
            sent_lp[i] = len(st.output_ids)
        done[i] = st.finished
        fin = finish_fields(st) if st.finished else {"finish_reason": None}
        text = (echoes[i] if echo else "") + delta
        first[i] = False
        c = {**head, "object": "text_completion", "choices": [{"index": i, "text": text, "logprobs": lp, **fin}]}
        if continuous:
            c["usage"] = usage([st], warm)
        yield c
    if body.include_usage:
        yield {**head, "object": "text_completion", "choices": [], "usage": usage([h.state for h in handles], warm)}
