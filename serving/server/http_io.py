"""Reading request bodies safely, server-sent events, and noticing clients that went away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from serving.server.errors import APIError, error_body, validation_message

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON: 413 over ``limit`` bytes, 400 for invalid UTF-8 or JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"the request body has {length} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, parse_constant=_no_constants)
    except (json.JSONDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None


async def parse_body(request: Request, model: type[M], limit: int) -> M:
    data = await read_json(request, limit)
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = validation_message(list(e.errors()))
        raise APIError(400, msg, param) from None


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
        yield sse(error_body(e.status, e.message, e.param, e.code))
    yield SSE_DONE
