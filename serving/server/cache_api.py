"""The KV control API: tenant-scoped routes that let a client (an agent framework) steer its KV.

Every route takes the prompt as ``prompt`` (text), ``messages`` (chat, templated as
/v1/chat/completions does) or ``input_ids``, plus an optional ``cache_salt``; the caller's
tenant (its API key) and salt select the cache space, as for a generation.

- ``POST /cache/lookup`` -> ``{"prompt_tokens", "cached_tokens": {"L1", "L2", "L3"}, "total"}``:
  leading tokens cached on L1, then on L2 only, then in L3 (read-only: counts no hit).
- ``POST /cache/prefetch`` -> brings the prompt's KV to L1 now (L2 and L3 hits are loaded, what
  no tier holds is computed), e.g. while a tool call runs, so the next turn starts at L1 speed.
  Answers once it is there: ``{"prompt_tokens", "cached_tokens_details"}`` (where it came from).
- ``POST /cache/pin`` with ``ttl_s`` -> ``{"lease_id", "pinned_tokens", "ttl_s"}``: the prefix
  stays in L2 (and L3) until the lease ends, a flush included; bounded by the tenant's L2 quota
  in distinct pages (409 past it), by the lease caps ``max_pin_leases`` /
  ``max_pin_leases_per_tenant`` (429) and ``ttl_s`` by ``max_pin_ttl_s`` (400 naming it).
  Unlike a cache_control breakpoint, it never makes room by releasing other leases: it is
  refused. ``DELETE /cache/pin/{lease_id}`` releases it early (404 for an
  unknown, expired or other tenant's lease).

The engine side is serving/cache/kv_control.py.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field, model_validator
from starlette.concurrency import run_in_threadpool

from common.tenants import effective_salt
from serving import ipc as m
from serving.scheduler.prompt_check import PromptError, check_prompt
from serving.server.context import ServerContext, check_salt, get_ctx
from serving.server.errors import APIError
from serving.server.http_io import parse_body, unless_disconnected
from serving.server.protocol import ChatMessage, StrictModel
from serving.server.req_handle import run_all
from serving.server.tenants import CURRENT

router = APIRouter()
MAX_TTL_S = 24 * 3600.0


class KVRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    input_ids: list[int] | None = None
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> KVRequest:
        if sum(x is not None for x in (self.prompt, self.messages, self.input_ids)) != 1:
            raise ValueError("give exactly one of prompt, messages or input_ids")
        return self


class PrefetchRequest(KVRequest):
    level: Literal["L1", "L2"] = "L1"  # where the KV must be when it answers (L1 is above L2)


class PinRequest(KVRequest):
    ttl_s: Annotated[float, Field(gt=0)]  # at most --max-pin-ttl-s: the engine's 400 names it
    breakpoint: bool = False  # also the caller's cache_control breakpoint of this prefix (a drain's re-pin)


class Retention(StrictModel):
    """``/open_session`` retention hints (serving/cache/kv_control.py)."""

    demote_on_idle: bool = False  # keep the session's KV on L2 (pinned) while it is idle
    ttl_s: Annotated[float, Field(gt=0, le=MAX_TTL_S)] | None = None  # close it after this long idle


async def _ids(ctx: ServerContext, body: KVRequest) -> list[int]:
    if body.model is not None:
        ctx.check_model(body.model)
    check_salt(body.cache_salt)
    if body.messages is not None:
        ids = await run_in_threadpool(ctx.chat_ids, [msg.as_template_dict() for msg in body.messages])
    elif body.prompt is not None:
        ids = await run_in_threadpool(ctx.prompt_ids, body.prompt)
    else:
        ids = list(body.input_ids or [])
    vocab = int(ctx.info["vocab_size"])
    try:  # the prompt's rules (serving/scheduler/prompt_check.py), this API's one message
        check_prompt(ids, vocab, ctx.context_len)
    except PromptError:
        raise APIError(400, f"the prompt must have 1 to {ctx.context_len - 1} tokens, each in [0, {vocab})",
                       param="input_ids" if body.input_ids is not None else None) from None
    return ids


async def _control(ctx: ServerContext, op: str, **args: Any) -> Any:
    tenant = CURRENT.get()
    return await ctx.client.call(m.KVControlCall, op=op, args=args, tenant=None if tenant is None else tenant.name)


@router.post("/cache/lookup")
async def lookup(request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    body = await parse_body(request, KVRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    ids = await _ids(ctx, body)
    out = await _control(ctx, "lookup", input_ids=ids, cache_salt=effective_salt(CURRENT.get(), body.cache_salt))
    tiers = {k: int(out[k]) for k in ("L1", "L2", "L3")}
    return {"prompt_tokens": len(ids), "cached_tokens": tiers, "total": sum(tiers.values())}


@router.post("/cache/prefetch")
async def prefetch(request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    body = await parse_body(request, PrefetchRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    ids = await _ids(ctx, body)
    req = ctx.make_request(ids, {"max_new_tokens": 1, "temperature": 0.0}, None, rid=f"prefetch-{uuid.uuid4().hex}",
                           cache_salt=body.cache_salt)
    [st] = await unless_disconnected(request, run_all(ctx.client, [req]))
    return {"prompt_tokens": st.prompt_tokens, "resident": "L1", "cached_tokens": st.cached_tokens,
            "cached_tokens_details": dict(st.cached_by_tier)}


@router.post("/cache/pin")
async def pin(request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    body = await parse_body(request, PinRequest, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    ids = await _ids(ctx, body)
    return await _control(ctx, "pin", input_ids=ids, cache_salt=effective_salt(CURRENT.get(), body.cache_salt),
                          request_salt=body.cache_salt, ttl_s=body.ttl_s, breakpoint=body.breakpoint)


@router.delete("/cache/pin/{lease_id}")
async def unpin(request: Request, lease_id: str) -> dict[str, Any]:
    ctx = get_ctx(request)
    if not 0 < len(lease_id) <= 128:
        raise APIError(400, "lease_id must be 1 to 128 characters", param="lease_id")
    return await _control(ctx, "unpin", lease_id=lease_id)
