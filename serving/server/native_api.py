"""SGLang's native /generate: ``text`` or ``input_ids``, SGLang ``sampling_params``, ``stream``.

Responses (and every streamed chunk) have SGLang's shape: cumulative ``text`` and
``output_ids`` plus ``meta_info`` (id, prompt_tokens, completion_tokens, cached_tokens,
cached_tokens_details, finish_reason), the same as the offline Engine's output.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from serving.server.context import ServerContext, get_ctx
from serving.server.errors import APIError
from serving.server.http_io import parse_body, sse_stream, unless_disconnected
from serving.server.protocol import GenerateRequest
from serving.server.req_handle import ReqHandle, ReqState, run_all, submit_all
from serving.server.text import TextStream, final_text

router = APIRouter()


def meta_info(st: ReqState) -> dict[str, Any]:
    return {
        "id": st.rid,
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": len(st.output_ids),
        "cached_tokens": st.cached_tokens,
        "cached_tokens_details": dict(st.cached_by_tier),
        "finish_reason": st.finish_reason,
        **({"l3_decision": st.l3_decision} if st.l3_decision else {}),
    }


@router.post("/generate")
async def generate(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await parse_body(request, GenerateRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    prompts = body.prompts
    if body.batched and (body.stream or body.rid is not None):
        raise APIError(400, "stream and rid need a single prompt, not a batch", param="stream")
    params = dict(body.sampling_params or {})
    ids = [await run_in_threadpool(ctx.encode, p) if isinstance(p, str) else p for p in prompts]  # off the loop
    reqs = [
        ctx.make_request(
            p,
            params,
            body.session_id,
            body.rid,
            param_name="max_new_tokens",
            bootstrap=body.bootstrap(i, len(ids)),
            cache_salt=body.cache_salt,
        )
        for i, p in enumerate(ids)
    ]
    skip = params.get("skip_special_tokens", True)
    if not body.stream:
        states = await unless_disconnected(request, run_all(ctx.client, reqs))
        outs = [
            {
                "text": final_text(ctx.tokenizer, st.output_ids, st.finish_reason, skip),
                "output_ids": list(st.output_ids),
                "meta_info": meta_info(st),
            }
            for st in states
        ]
        return outs if body.batched else outs[0]
    [handle] = await submit_all(ctx.client, reqs)
    stop = params.get("stop") or ()
    return StreamingResponse(
        sse_stream(_chunks(ctx, handle, [stop] if isinstance(stop, str) else stop, skip)),
        media_type="text/event-stream",
    )


async def _chunks(ctx: ServerContext, handle: ReqHandle, stop: list[str], skip: bool) -> AsyncIterator[Any]:
    text = TextStream(ctx.tokenizer, stop, skip)
    try:
        async for st in handle.updates():
            text.update(st)
            cumulative = (
                final_text(ctx.tokenizer, st.output_ids, st.finish_reason, skip) if st.finished else text.text
            )
            yield {
                "text": cumulative,
                "output_ids": list(st.output_ids),
                "meta_info": meta_info(st),
                "index": 0,
            }
    finally:
        handle.close()
