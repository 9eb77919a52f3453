"""Request bodies at the router: a size limit before anything is read or forwarded, and JSON
parsed with a depth limit, as on the workers (serving/server/http_io.py).

:class:`BodyLimitMiddleware` reads each request's body before any route sees it, at most
``max_request_bytes``: a declared ``Content-Length`` over the limit is a 413 at once (nothing
read), a body whose bytes pass it (chunked, or longer than declared) a 413 as soon as they do;
nothing is forwarded to a worker either way. The routes then get the body from memory.
:func:`json_body` parses a body, 400 for invalid JSON or nesting deeper than ``max_json_depth``
(common/json_depth.py: checked before parsing, so a 100k-deep body never reaches the recursive
parser). Errors are in the shape of the path's API (router/errors.py).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.json_depth import too_deep
from router.errors import error


def too_deep_message(max_depth: int) -> str:
    return f"the request body nests arrays and objects deeper than the limit of {max_depth} (max_json_depth)"


def json_body(raw: bytes, path: str, max_depth: int) -> Any:
    """The body as JSON, or the 400 (a JSONResponse in ``path``'s API shape) naming what is wrong."""
    if too_deep(raw, max_depth):
        return error(400, too_deep_message(max_depth), path)
    try:
        return json.loads(raw)
    except RecursionError:
        return error(400, too_deep_message(max_depth), path)
    except ValueError:
        return error(400, "the body is not valid JSON", path)


def json_object(raw: bytes, path: str, max_depth: int) -> dict[str, Any] | JSONResponse:
    """The body as a JSON object, or the 400 naming what is wrong."""
    body = json_body(raw, path, max_depth)
    if isinstance(body, JSONResponse):
        return body
    if not isinstance(body, dict):
        return error(400, "the body must be a JSON object", path)
    return body


class BodyLimitMiddleware:
    """Reads the whole body (at most ``limit`` bytes) before the app runs, then replays it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        length = dict(scope.get("headers") or []).get(b"content-length", b"").decode("latin-1").strip()
        if length.isdigit() and int(length) > self.limit:
            why = f"the request body has {length} bytes; the limit is {self.limit} (max_request_bytes)"
            await self._refuse(scope, receive, send, path, why)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":  # the client left while sending: nothing to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                why = f"the request body is over the limit of {self.limit} bytes (max_request_bytes)"
                await self._refuse(scope, receive, send, path, why)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, path: str, message: str) -> None:
        answer = error(413, message, path)
        answer.headers["connection"] = "close"  # the rest of the body is never read
        await answer(scope, receive, send)
