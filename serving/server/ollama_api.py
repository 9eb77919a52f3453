"""The Ollama API: POST /api/chat, POST /api/generate, GET /api/tags, POST /api/show, GET /api/version.

Requests map onto the same engine path as the other routes (chat template, sampling params,
HiCache's ``session_id``). ``options`` take Ollama's names (``num_predict``, ``repeat_penalty``,
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop``, ...); runtime options that
cannot change the answer (``num_ctx``, ``num_thread``, ``num_gpu``, ...) are accepted and ignored,
sampling options HiCache does not implement only at their neutral value. ``format`` is ``"json"``
or a JSON schema (structured output). As Ollama does, ``stream`` defaults to true: NDJSON lines,
the last one with ``done: true`` and the counts; ``prompt_eval_count`` counts the prompt tokens
computed, so a prompt served from the cache shows a small one (as Ollama's own cache does).
A model name may carry Ollama's ``:latest`` tag. Errors are ``{"error": "..."}``. As Ollama does,
a body is read as JSON whatever its ``Content-Type`` (its clients send none, ``curl -d`` a form
type); browsers stay out through the Origin and Host checks (app.py, trusted_hosts.py). Tools,
tool calls and ``think`` (with ``--tool-call-parser`` / ``--reasoning-parser``): ollama_tools.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from functools import wraps
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from common.prompt_form import ollama_chat, ollama_generate
from serving import compat_fields
from serving.parsing.output import OutputParser, OutputStream
from serving.server.chat_output import ToolRequest, answer_params, output_parser, strip_eos
from serving.server.context import ServerContext, get_ctx
from serving.server.errors import APIError
from serving.server.http_io import parse_body, unless_disconnected
from serving.server.ollama_tools import (
    OllamaToolCall,
    Think,
    message,
    message_deltas,
    separates_thinking,
    template_kwargs,
    tool_request,
)
from serving.server.openai_tools import FunctionTool
from serving.server.protocol import StrictModel
from serving.server.req_handle import ReqHandle, ReqState, run_all, submit_all
from serving.server.text import TextStream, final_text
from serving.structs.grammar_spec import response_format_params

router = APIRouter()
OLLAMA_VERSION = "0.6.3"  # the API version these routes follow (the ollama client's)
ANY = compat_fields.ANY
B = TypeVar("B", bound=StrictModel)


def ollama_errors(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @wraps(fn)
    async def wrapper(request: Request) -> Any:
        try:
            return await fn(request)
        except APIError as e:
            return JSONResponse({"error": e.message}, status_code=e.status)

    return wrapper


class Options(StrictModel):
    neutral_fields = {
        **{k: ANY for k in ("numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv",
                            "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep",
                            "penalize_newline", "mirostat_tau", "mirostat_eta", "repeat_last_n")},
        "logits_all": (False,), "tfs_z": (1,), "typical_p": (1,), "mirostat": (0,),
    }
    seed: int | None = None
    num_predict: int | None = None  # -1: until the context is full (-2 too)
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    temperature: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | None = None

    def sampling_params(self, default_max: int) -> dict[str, Any]:
        n = self.num_predict
        p = {"max_new_tokens": default_max if n is None or n < 0 else n, "seed": self.seed, "top_k": self.top_k,
             "top_p": self.top_p, "min_p": self.min_p, "temperature": self.temperature,
             "repetition_penalty": self.repeat_penalty, "presence_penalty": self.presence_penalty,
             "frequency_penalty": self.frequency_penalty, "stop": self.stop}
        return {k: v for k, v in p.items() if v is not None}


class OllamaMessage(StrictModel):
    neutral_fields = {"images": ((), [])}
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[OllamaToolCall] | None = None  # an assistant's earlier calls
    thinking: str | None = None  # an assistant's earlier reasoning: not shown to the model again
    tool_name: str | None = None  # on a tool's answer: which tool answered


class _Base(StrictModel):
    model: str
    stream: bool = True
    options: Options | None = None
    format: Literal["", "json"] | dict[str, Any] | None = None
    keep_alive: Any = None  # how long Ollama keeps a model loaded: nothing to unload here
    session_id: str | None = None  # HiCache's session (as on the other routes)
    think: Think = None  # ollama_tools.py

    def tool_request(self) -> ToolRequest | None:
        return None  # /api/generate has no tools

    def grammar(self) -> dict[str, Any]:
        if not self.format:
            return {}
        if self.format == "json":
            return response_format_params({"type": "json_object"})
        try:
            return response_format_params({"type": "json_schema",
                                           "json_schema": {"name": "format", "schema": self.format}})
        except ValueError as e:
            raise APIError(400, f"format: {e}", param="format") from None


class ChatRequest(_Base):
    neutral_fields = {"logprobs": (False,), "top_logprobs": (0,)}
    messages: Annotated[list[OllamaMessage], Field(min_length=1)]
    tools: list[FunctionTool] | None = None

    def tool_request(self) -> ToolRequest | None:
        return tool_request(self.tools)

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages the chat template sees (common/prompt_form.py, as the router's key)."""
        tools = [t.model_dump() for t in self.tools] if self.tools else None
        return ollama_chat([x.model_dump(exclude_none=True) for x in self.messages], tools)


class GenerateRequest(_Base):
    neutral_fields = {"images": ((), []), "logprobs": (False,), "top_logprobs": (0,),
                      "context": ((), []), "suffix": ("",), "template": ("",), "width": (), "height": (),
                      "steps": ()}
    prompt: str = ""
    system: str | None = None
    raw: bool = False

    def template_messages(self) -> list[dict[str, Any]]:
        """Without ``raw``, the prompt goes through the chat template as the user's message, after
        ``system`` (common/prompt_form.py, as the router's key)."""
        return ollama_generate(self.prompt, self.system)


class ShowRequest(StrictModel):
    neutral_fields = {"verbose": ANY}
    model: str | None = None
    name: str | None = None  # the older spelling


async def _body(request: Request, model: type[B]) -> B:
    """The body as ``model``: JSON whatever its declared type, as Ollama reads it."""
    ctx = get_ctx(request)
    return await parse_body(request, model, ctx.server.max_request_bytes, ctx.server.max_json_depth, json_type=False)


def _model(ctx: ServerContext, name: str) -> str:
    ctx.check_model(name.removesuffix(":latest"))
    return name


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _final(st: ReqState, t0: float) -> dict[str, Any]:
    total = int((time.monotonic() - t0) * 1e9)
    first = st.first_token_time or time.monotonic()
    prompt_ns = int(max(first - st.created, 0) * 1e9)
    reason = (st.finish_reason or {}).get("type")
    return {"done": True, "done_reason": "length" if reason == "length" else "stop", "total_duration": total,
            "load_duration": 0, "prompt_eval_count": st.prompt_tokens - st.cached_tokens,
            "prompt_eval_duration": prompt_ns, "eval_count": len(st.output_ids),
            "eval_duration": max(total - prompt_ns, 0)}


def _chat_answer(msg: dict[str, Any]) -> dict[str, Any]:
    return {"message": msg}


def _generate_answer(msg: dict[str, Any]) -> dict[str, Any]:
    return {"response": msg["content"], **({"thinking": msg["thinking"]} if "thinking" in msg else {})}


async def _run(request: Request, ctx: ServerContext, body: _Base, ids: list[int],
               answer: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """Run the request; ``answer`` shapes an assistant message (ollama_tools.py) as the route's
    fields (chat: ``message``; generate: ``response`` and ``thinking``)."""
    opts = body.options or Options()
    tools = body.tool_request()
    parser = output_parser(ctx, tools, separates_thinking(body.think), ids)
    params = answer_params(ctx, parser, tools,
                           {**opts.sampling_params(ctx.default_max_tokens(len(ids))), **body.grammar()})
    req = ctx.make_request(ids, params, body.session_id, param_name="num_predict")
    t0 = time.monotonic()
    if not body.stream:
        [st] = await unless_disconnected(request, run_all(ctx.client, [req]))
        text = final_text(ctx.tokenizer, st.output_ids, st.finish_reason, not parser.keeps_special_tokens)
        msg = message(parser, strip_eos(ctx, parser, text))
        return {"model": body.model, "created_at": _now(), **answer(msg), **_final(st, t0)}
    [handle] = await submit_all(ctx.client, [req])
    return StreamingResponse(_lines(ctx, body, handle, answer, parser, opts.stop or [], t0),
                             media_type="application/x-ndjson")


async def _lines(ctx: ServerContext, body: _Base, handle: ReqHandle, answer: Callable[[dict[str, Any]], Any],
                 parser: OutputParser, stop: list[str], t0: float) -> AsyncIterator[str]:
    text = TextStream(ctx.tokenizer, stop, not parser.keeps_special_tokens)
    out = OutputStream(parser)

    def line(msg: dict[str, Any], **rest: Any) -> str:
        return json.dumps({"model": body.model, "created_at": _now(), **answer(msg), **rest}) + "\n"

    try:
        async for st in handle.updates():
            delta = text.update(st)
            if not parser.active:
                msgs = [{"role": "assistant", "content": delta}] if delta else []
            elif delta or st.finished:
                full = strip_eos(ctx, parser, text.text) if st.finished else text.text
                msgs = message_deltas(out.update(full, st.finished))
            else:
                msgs = []
            for m in msgs:
                yield line(m, done=False)
            if st.finished:
                yield line({"role": "assistant", "content": ""}, **_final(st, t0))
    except APIError as e:
        yield json.dumps({"error": e.message}) + "\n"
    finally:
        handle.close()


@router.post("/api/chat")
@ollama_errors
async def chat(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await _body(request, ChatRequest)
    _model(ctx, body.model)
    ids = await run_in_threadpool(ctx.chat_ids, body.template_messages(), template_kwargs(body.think))
    return await _run(request, ctx, body, ids, _chat_answer)


@router.post("/api/generate")
@ollama_errors
async def generate(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await _body(request, GenerateRequest)
    _model(ctx, body.model)
    if not body.prompt:  # Ollama: an empty prompt only loads the model
        return {"model": body.model, "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
    if body.raw:
        ids = await run_in_threadpool(ctx.prompt_ids, body.prompt)
    else:
        ids = await run_in_threadpool(ctx.chat_ids, body.template_messages(), template_kwargs(body.think))
    return await _run(request, ctx, body, ids, _generate_answer)


def quantization_level(info: dict[str, Any]) -> str:
    """The weights' mode as the engine reports it (``/get_server_info``'s ``engine.quantization``:
    what ``--quantization`` resolved to, e.g. int4); unquantized weights, their dtype (float32)."""
    mode = str(info.get("quantization", "none"))
    return mode if mode != "none" else str(info.get("dtype", ""))


def _details(ctx: ServerContext) -> dict[str, Any]:
    arch = str(ctx.info.get("architecture", "llama"))
    return {"parent_model": "", "format": "safetensors", "family": arch, "families": [arch],
            "parameter_size": "", "quantization_level": quantization_level(ctx.info)}


@router.get("/api/tags")
@ollama_errors
async def tags(request: Request) -> Any:
    ctx = get_ctx(request)
    name = ctx.model_name
    return {"models": [{"name": name, "model": name, "modified_at": _now(), "size": 0, "digest": "",
                        "details": _details(ctx)}]}


@router.post("/api/show")
@ollama_errors
async def show(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await _body(request, ShowRequest)
    name = body.model or body.name
    if not name:
        raise APIError(400, "model is required")
    _model(ctx, name)
    template = getattr(getattr(ctx.tokenizer, "hf", None), "chat_template", None) or ""
    return {"modelfile": "", "parameters": "", "template": template if isinstance(template, str) else "",
            "details": _details(ctx), "capabilities": ["completion"], "modified_at": _now(),
            "model_info": {"general.architecture": _details(ctx)["family"],
                           "general.context_length": ctx.context_len}}


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_VERSION}


