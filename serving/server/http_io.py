"""Reading request bodies safely, server-sent events, refusals from ASGI middleware, and
noticing clients that went away.

A JSON body must come with ``Content-Type: application/json`` (or ``application/<x>+json``),
else 415: a browser can send a cross-origin POST without asking first only with a form or
text/plain type, so this is a second guard after the Origin and Host checks (app.py,
trusted_hosts.py). Ollama's routes take a body of any declared type, as Ollama does
(``json_type=False``; its clients send none, ``curl -d`` a form type). Bodies over the size
limit are a 413, nested deeper than ``max_json_depth`` a 400 (checked before parsing), and a
client that goes away while sending is not an error (499, nothing logged); one too slow to send
it (edge/http_protocol.py closed the connection) is a 408. A body sent with a
``Content-Encoding`` other than identity is a 415 (none is decoded, as in SGLang and vLLM), and a
string anywhere in the JSON with a lone surrogate (``"\\ud800"``, which no UTF-8 text can hold)
is a 400 naming the field, once, here: every route's fields are then encodable.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import Send

from common.json_depth import DEFAULT_MAX_DEPTH, too_deep
from edge.http_protocol import TIMED_OUT
from serving.server.errors import APIError, clip, error_body, validation_message

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a surrogate (paired or not)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def check_json_type(request: Request) -> None:
    """415 unless the body is declared JSON."""
    declared = request.headers.get("content-type")
    media = (declared or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise APIError(415, "the request body must be JSON sent with Content-Type: application/json"
                        + (f" (got {declared[:100]!r})" if declared else " (no Content-Type was sent)"))


def check_identity_encoding(request: Request) -> None:
    """415 for a compressed (or otherwise encoded) body: none is decoded."""
    encoding = request.headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise APIError(415, f"Content-Encoding {clip(encoding, 100)!r} is not supported: send the request body "
                            "uncompressed (no Content-Encoding, or identity)")


def _where(path: tuple[str | int, ...]) -> str:
    return ".".join(clip(str(p), 100) for p in path) or "the request body"


def check_unicode(data: Any) -> None:
    """400 naming the first string (or field name) that holds a lone surrogate: valid JSON
    (``"\\ud800"``) that is not valid Unicode, so no UTF-8 encoder (the tokenizer, the stop
    strings' matcher, the salt's hash, the engine's messages) can take it."""
    todo: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            for key in value:
                _check_text(key, path, "a field name is ")
            todo.extend(reversed([((*path, k), v) for k, v in value.items()]))
        elif isinstance(value, list):
            todo.extend(reversed([((*path, i), v) for i, v in enumerate(value)]))
        elif isinstance(value, str):
            _check_text(value, path, "")


def _check_text(text: str, path: tuple[str | int, ...], what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # the message shows the surrogate escaped: repr() does
        raise APIError(400, f"{_where(path)}: {what}not valid Unicode, a lone surrogate ({text[e.start]!r}) at "
                            f"character {e.start} (surrogates come in pairs)",
                       param=str(path[0]) if path else None) from None


async def read_json(request: Request, limit: int, max_depth: int = DEFAULT_MAX_DEPTH, json_type: bool = True) -> Any:
    """The body as JSON: 415 unless declared JSON (with ``json_type``) or when it is encoded
    (``Content-Encoding``), 413 over ``limit`` bytes, 400 for invalid UTF-8 or JSON or
    nesting deeper than ``max_depth`` or a lone surrogate in a string; 499 if the client
    leaves meanwhile, 408 if it was too slow to send the body (the connection was closed)."""
    check_identity_encoding(request)
    if json_type:
        check_json_type(request)
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body has {length} bytes; the limit is {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        timed_out = (request.scope.get("state") or {}).get(TIMED_OUT)
        if timed_out:  # the client was answered 408 and the connection closed (http_protocol.py)
            raise APIError(408, timed_out) from None
        raise APIError(499, "the client closed the connection before it sent the whole body") from None
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    deep = f"the request body nests arrays and objects deeper than the limit of {max_depth} (max_json_depth)"
    if too_deep(raw, max_depth):  # checked before parsing (common/json_depth.py, as the router does)
        raise APIError(400, deep)
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise APIError(400, deep) from None
    except (json.JSONDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(raw):  # only then can a string hold a lone one (UTF-8 text cannot)
        check_unicode(data)
    return data


async def parse_body(request: Request, model: type[M], limit: int, max_depth: int = DEFAULT_MAX_DEPTH,
                     json_type: bool = True) -> M:
    data = await read_json(request, limit, max_depth, json_type)
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = validation_message(list(e.errors()))
        raise APIError(400, msg, param) from None


async def asgi_refuse(send: Send, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """Answer an ASGI request with an error in OpenAI's shape (for middleware, before any route)."""
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *headers]})
    await send({"type": "http.response.body", "body": body})


async def wait_disconnect(request: Request) -> None:
    """Return when the client closes the connection (call after the body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it (which aborts its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
    if not task.done() or task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_stream(chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
    """Events for each chunk, an error event if the engine fails midway, then ``[DONE]``."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except APIError as e:
        yield sse(error_body(e.status, e.message, e.param, e.code, e.kind))
    yield SSE_DONE
