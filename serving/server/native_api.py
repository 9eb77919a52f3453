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

from serving.runner.logprob_meta import sglang_meta
from serving.server import cache_control
from serving.server.context import ServerContext, get_ctx
from serving.server.errors import APIError
from serving.server.fanout import check_n, choices, scoring, trim_scoring, warm_prefix
from serving.server.http_io import parse_body, sse_stream, unless_disconnected
from serving.server.protocol import GenerateRequest
from serving.server.req_handle import ReqHandle, ReqState, merged_updates, run_all, submit_all
from serving.server.text import TextStream, final_text
from serving.structs.logprob_options import LogprobOptions

router = APIRouter()


def meta_info(st: ReqState, logprobs: tuple[LogprobOptions, Any, bool] | None = None) -> dict[str, Any]:
    """SGLang's meta_info; with ``logprobs`` (options, tokenizer, return_text_in_logprobs) its logprobs."""
    return {
        **(sglang_meta(st.logprobs, *logprobs) if logprobs is not None else {}),
        "id": st.rid,
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": len(st.output_ids),
        "cached_tokens": st.cached_tokens,
        "cached_tokens_details": dict(st.cached_by_tier),
        "finish_reason": st.finish_reason,
        **({"l3_decision": st.l3_decision} if st.l3_decision else {}),
        **(st.spec or {}),  # speculative decoding: spec_verify_ct, spec_accept_length, ... (SGLang's)
    }


@router.post("/generate")
async def generate(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await parse_body(request, GenerateRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    prompts = body.prompts
    params = dict(body.sampling_params or {})
    n = check_n(params.pop("n", None), "sampling_params.n")
    if (body.batched or n > 1) and body.rid is not None:
        raise APIError(400, "rid needs a single prompt and n=1, not a batch", param="rid")
    opts = None
    if body.return_logprob:
        ids_lp = None if body.token_ids_logprob is None else tuple(body.token_ids_logprob)
        opts = LogprobOptions(body.logprob_start_len, body.top_logprobs_num or 0, ids_lp)
    # max_new_tokens 0 is a prefill (as in SGLang): the prompt's KV goes into the tree, e.g. a
    # shared prefix before its branches (serving.lang's fork); it also scores a prompt with logprobs
    score = params.get("max_new_tokens") == 0 or scoring(params, opts is not None and opts.start_len not in (None, -1))
    if score:
        params["max_new_tokens"] = 1  # a prefill: the one token is dropped (serving.server.fanout)
    ids = [await run_in_threadpool(ctx.prompt_ids, p) if isinstance(p, str) else p for p in prompts]  # off the loop
    reqs = [
        ctx.make_request(
            p,
            params,
            body.session_id,
            body.rid,
            param_name="max_new_tokens",
            bootstrap=body.bootstrap(i, len(ids)),
            cache_salt=body.cache_salt,
            logprobs=opts,
        )
        for i, p in enumerate(ids)
    ]
    bps = cache_control.whole_prompt(body.cache_control, ids[0])
    if bps and (len(ids) != 1 or n > 1 or score):
        raise APIError(400, "cache_control: needs one prompt and n = 1", param="cache_control")
    if n > 1:  # one prefill per prompt, n decodes sharing it
        await unless_disconnected(request, warm_prefix(ctx.client, reqs))
        reqs = [c for r in reqs for c in choices(r, n)]
    lp = (opts, ctx.tokenizer, body.return_text_in_logprobs) if opts is not None else None
    skip = params.get("skip_special_tokens", True)
    if not body.stream:
        states = await unless_disconnected(request, run_all(ctx.client, reqs))
        states = [trim_scoring(st) for st in states] if score else states
        outs = [
            {
                "text": final_text(ctx.tokenizer, st.output_ids, st.finish_reason, skip),
                "output_ids": list(st.output_ids),
                "meta_info": meta_info(st, lp),
            }
            for st in states
        ]
        if bps:
            pins = await cache_control.apply(ctx, ids[0], bps, states[0], body.cache_salt)
            outs[0]["meta_info"]["cache_control"] = cache_control.meta(states[0], pins)
        return outs if body.batched or n > 1 else outs[0]
    handles = await submit_all(ctx.client, reqs)
    stop = params.get("stop") or ()
    return StreamingResponse(
        sse_stream(_chunks(ctx, handles, [stop] if isinstance(stop, str) else stop, skip, lp, score,
                           (ids[0], bps, body.cache_salt) if bps else None)),
        media_type="text/event-stream",
    )


async def _chunks(ctx: ServerContext, handles: list[ReqHandle], stop: list[str], skip: bool,
                  lp: tuple[LogprobOptions, Any, bool] | None, score: bool,
                  pin: tuple[list[int], list[cache_control.Breakpoint], str | None] | None = None,
                  ) -> AsyncIterator[Any]:
    """Cumulative chunks; a batch or n > 1 interleaves its requests, each chunk with its ``index``
    (prompt i's choice j is index i * n + j), as SGLang streams them. With ``pin`` (one prompt's
    ``cache_control``) the breakpoint is pinned once the request finished: the last chunk's
    ``meta_info.cache_control`` has the counts, as the non-streamed answer's."""
    texts = [TextStream(ctx.tokenizer, stop, skip) for _ in handles]
    async for i, st in merged_updates(handles):
        text = texts[i]
        if score:
            if not st.finished:
                continue
            st = trim_scoring(st)
        text.update(st)
        cumulative = final_text(ctx.tokenizer, st.output_ids, st.finish_reason, skip) if st.finished else text.text
        meta = meta_info(st, lp)
        if pin is not None and st.finished:
            meta["cache_control"] = cache_control.meta(st, await cache_control.apply(ctx, pin[0], pin[1], st, pin[2]))
        yield {"text": cumulative, "output_ids": list(st.output_ids), "meta_info": meta, "index": i}
