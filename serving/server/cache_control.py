"""Prompt-caching breakpoints, HTTP side: Anthropic's ``cache_control`` on /v1/messages and the
same field on the OpenAI and native routes (engine side: serving/cache/kv_breakpoints.py).

- ``{"type": "ephemeral"}`` with an optional ``"ttl": "5m" | "1h"`` (Anthropic's; default
  5 minutes). On /v1/messages it may sit on a tool definition, a system text block or a
  message's content block (text, tool_use, tool_result): the prefix up to and including that
  block is pinned for the TTL, for the caller's tenant. The top-level ``cache_control``
  (Anthropic's automatic caching) is a breakpoint on the last message. At most 4 breakpoints
  a request (Anthropic's limit): a 400 past it, as for a bad type or TTL; /v1/messages and
  /v1/messages/count_tokens check them with the one function :func:`anthropic_points`.
- Best-effort, as Anthropic's prompt caching: a request is never refused for its
  breakpoints. They are pinned after it ran (serving/cache/kv_breakpoints.py: the tenant's
  least recently used breakpoints give way when its pin quota or a lease cap is reached); one
  that cannot be pinned is reported, not failed.
- OpenAI (/v1/chat/completions, /v1/completions) and native (/generate): a top-level
  ``cache_control`` with the same shape pins the whole prompt. Neither SGLang nor vLLM has a
  field for this (SGLang's pinning was reverted), so Anthropic's spelling is reused.
- Accounting (:func:`anthropic_usage`): ``cache_read_input_tokens`` = prompt tokens served from
  the cache (any tier), ``cache_creation_input_tokens`` = tokens up to a new breakpoint that the
  request wrote into the cache and did not read from it, pinned or not (kv_breakpoints.py), by TTL
  in Anthropic's ``cache_creation``
  (``ephemeral_5m_input_tokens``, ``ephemeral_1h_input_tokens``), ``input_tokens`` the rest
  (the three sum to the prompt). HiCache's ``cache_control`` object in the usage says what
  became of the breakpoints: ``pinned_tokens`` (the prompt's prefix pinned now, by this request
  or an earlier one), ``not_pinned`` (each breakpoint not, or not wholly, pinned, with the
  reason) and ``released_breakpoints`` (the tenant's older ones that gave way). The OpenAI and
  native routes carry :func:`meta` (the same counts, per tier) in ``meta_info.cache_control``.
- ``POST /debug/advance_kv_clock {"seconds"}`` (``--enable-debug-endpoints`` only) moves the lease
  clock on, so a test sees a TTL end without waiting for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from common.tenants import effective_salt
from serving import ipc as m
from serving.cache.kv_breakpoints import MAX_BREAKPOINTS
from serving.server.anthropic_tools import system_text, tools_text
from serving.server.context import ServerContext, get_ctx
from serving.server.errors import APIError
from serving.server.http_io import read_json
from serving.server.req_handle import ReqState
from serving.server.tenants import CURRENT

router = APIRouter()
TTLS_S = {"5m": 300.0, "1h": 3600.0}


@dataclass(frozen=True)
class Breakpoint:
    end: int  # prompt tokens up to and including the block
    ttl_s: float


def ttl_of(cc: Any, where: str) -> float:
    """The TTL (seconds) of one ``cache_control`` value; a 400 naming ``where`` when it is bad."""
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        raise APIError(400, f'{where}.cache_control: must be {{"type": "ephemeral"}} (optionally with "ttl": '
                            '"5m" or "1h")', param=f"{where}.cache_control")
    extra = set(cc) - {"type", "ttl"}
    if extra:
        raise APIError(400, f"{where}.cache_control: unknown field(s) {sorted(extra)}", param=f"{where}.cache_control")
    ttl = cc.get("ttl", "5m")
    if ttl not in TTLS_S:
        raise APIError(400, f'{where}.cache_control.ttl: must be "5m" or "1h", got {ttl!r}',
                       param=f"{where}.cache_control.ttl")
    return TTLS_S[ttl]


def check_count(n: int) -> None:
    if n > MAX_BREAKPOINTS:
        raise APIError(400, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {n}.",
                       param="cache_control")


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _blocks(content: Any) -> list[Any]:
    return [] if content is None or isinstance(content, str) else list(content)


def _text(blocks: list[Any]) -> str:
    return "".join(b.render() for b in blocks)


def anthropic_points(body: Any, prefixes: bool = False) -> list[tuple[list[dict[str, Any]], float]]:
    """Every ``cache_control`` of a MessagesRequest or CountTokensRequest, checked (:func:`ttl_of`,
    :func:`check_count`: a 400 naming the bad one), in Anthropic's order -- tools (a text block
    before the system text, serving/server/anthropic_tools.py), system, messages, the top level
    -- each with its TTL and, with ``prefixes``, the messages up to and including its block."""
    found: list[tuple[list[dict[str, Any]], float]] = []  # the messages up to the block, its TTL
    tools = body.tools or []
    for i, t in enumerate(tools):
        if t.cache_control is not None:
            ttl = ttl_of(t.cache_control, f"tools[{i}]")
            found.append(([{"role": "system", "content": tools_text(tools[: i + 1])}] if prefixes else [], ttl))
    system = _blocks(body.system)
    whole = system_text(tools, _text(system) if system else body.system or "") if prefixes else ""
    done = [{"role": "system", "content": whole}] if whole else []
    for i, b in enumerate(system):
        if b.cache_control is not None:
            ttl = ttl_of(b.cache_control, f"system[{i}]")
            found.append(([{"role": "system", "content": system_text(tools, _text(system[: i + 1]))}]
                          if prefixes else [], ttl))
    for j, msg in enumerate(body.messages):
        blocks = _blocks(msg.content)
        for i, b in enumerate(blocks):
            if b.cache_control is not None:
                ttl = ttl_of(b.cache_control, f"messages[{j}].content[{i}]")
                found.append(([*done, {"role": msg.role, "content": _text(blocks[: i + 1])}] if prefixes else [], ttl))
        if prefixes:
            done.append({"role": msg.role, "content": msg.content if isinstance(msg.content, str) else _text(blocks)})
    if body.cache_control is not None:  # automatic caching: the last message is the breakpoint
        found.append((done, ttl_of(body.cache_control, "request")))
    check_count(len(found))
    return found


def anthropic_breakpoints(ctx: ServerContext, body: Any, ids: list[int]) -> list[Breakpoint]:
    """The breakpoints of a MessagesRequest whose prompt is ``ids`` (runs in a worker thread: it
    renders the chat template once per breakpoint). Each ends where the prompt rendered up to and
    including its block stops agreeing with the whole prompt."""
    out = []
    for msgs, ttl in anthropic_points(body, prefixes=True):
        text = ctx.tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
        out.append(Breakpoint(_lcp(ids, ctx.encode(text)), ttl))
    return out


def whole_prompt(cc: Any, ids: list[int]) -> list[Breakpoint]:
    """The OpenAI / native routes' top-level ``cache_control``: the whole prompt."""
    return [] if cc is None else [Breakpoint(len(ids), ttl_of(cc, "request"))]


async def _control(ctx: ServerContext, op: str, **args: Any) -> Any:
    tenant = CURRENT.get()
    return await ctx.client.call(m.KVControlCall, op=op, args=args, tenant=None if tenant is None else tenant.name)


async def apply(ctx: ServerContext, ids: list[int], bps: list[Breakpoint], st: ReqState,
                cache_salt: str | None = None) -> dict[str, Any]:
    """Pin / refresh the breakpoints after the request ran; the counts for its usage."""
    if not bps:
        return {"created_tokens": 0, "pinned_tokens": 0}
    return await _control(ctx, "cache_control", input_ids=ids, ends=[b.end for b in bps],
                          ttls=[b.ttl_s for b in bps], read=st.cached_tokens,
                          cache_salt=effective_salt(CURRENT.get(), cache_salt), request_salt=cache_salt)


def _outcome(res: dict[str, Any]) -> dict[str, Any]:
    """What became of a request's breakpoints (HiCache's; see the module docstring)."""
    return {"pinned_tokens": int(res.get("pinned_tokens", 0)), "refreshed_tokens": int(res.get("refreshed_tokens", 0)),
            "not_pinned": list(res.get("not_pinned", [])),
            "released_breakpoints": int(res.get("released_breakpoints", 0))}


def anthropic_usage(st: ReqState, res: dict[str, Any] | None) -> dict[str, Any]:
    created = int((res or {}).get("created_tokens", 0))
    hour = sum(int(n) for ttl, n in (res or {}).get("created_by_ttl", []) if ttl >= TTLS_S["1h"])
    read = st.cached_tokens
    out = {"input_tokens": max(0, st.prompt_tokens - read - created), "output_tokens": len(st.output_ids),
           "cache_read_input_tokens": read, "cache_creation_input_tokens": created,
           "cache_creation": {"ephemeral_5m_input_tokens": created - hour, "ephemeral_1h_input_tokens": hour},
           "cache_read_input_tokens_details": dict(st.cached_by_tier)}  # HiCache's: by tier
    if res and "not_pinned" in res:
        out["cache_control"] = _outcome(res)  # HiCache's: what became of the breakpoints
    return out


def meta(st: ReqState, res: dict[str, Any]) -> dict[str, Any]:
    """``meta_info.cache_control`` of the OpenAI and native routes."""
    return {"cache_read_tokens": st.cached_tokens, "cache_read_tokens_details": dict(st.cached_by_tier),
            "cache_creation_tokens": int(res.get("created_tokens", 0)), **_outcome(res)}


@router.post("/debug/advance_kv_clock")
async def advance_kv_clock(request: Request) -> dict[str, Any]:
    ctx = get_ctx(request)
    if not ctx.server.enable_debug_endpoints:
        raise APIError(404, "no such route (start the server with --enable-debug-endpoints)")
    body = await read_json(request, ctx.server.max_request_bytes, ctx.server.max_json_depth)
    try:
        seconds = float(body["seconds"])
    except (ValueError, KeyError, TypeError):
        raise APIError(400, 'the body must be {"seconds": <number>}', param="seconds") from None
    return await _control(ctx, "advance_clock", seconds=seconds)


async def breakpoints_for(ctx: ServerContext, body: Any, ids: list[int]) -> list[Breakpoint]:
    return await run_in_threadpool(anthropic_breakpoints, ctx, body, ids)
