"""Errors in each API's own shape, as the workers answer them (serving/server/errors.py,
anthropic_api.py, ollama_api.py; the router talks to workers over HTTP only, so the shapes are
copied here, not imported).

Which API a path belongs to (:func:`shape_for`): ``/v1/messages...`` is Anthropic's, ``/api/...``
Ollama's, anything else OpenAI's (SGLang's native ``/generate`` too: its workers answer OpenAI's
shape). Each :class:`Shape` gives

- a JSON error body: OpenAI ``{"error": {"message", "type", "param", "code"}}`` (``code``: the
  status as a string), Anthropic ``{"type": "error", "error": {"type", "message"}}``, Ollama
  ``{"error": message}``;
- the end of a stream that broke after its 200 (:meth:`Shape.stream_error`): OpenAI / SGLang an
  SSE ``data: {error}`` event then ``data: [DONE]``; Anthropic an ``event: error``; Ollama an
  NDJSON ``{"error": ...}`` line; and ``delimiter``, what ends one event of that stream.

:func:`install` makes the router app's own failures (unknown route, wrong method, an exception)
answer in the shape of the path they were asked on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 415: "invalid_request_error", 429: "rate_limit_error", 499: "client_closed_request",
                 503: "service_unavailable", 504: "timeout_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 504: "timeout_error"}


def _kind(table: dict[int, str], status: int, server_error: str) -> str:
    return table.get(status, "invalid_request_error" if status < 500 else server_error)


@dataclass(frozen=True)
class Shape:
    """One API's error shape (the OpenAI one; subclasses override)."""

    name: str = "openai"
    delimiter: bytes = b"\n\n"  # SSE: an event ends with a blank line

    def body(self, status: int, message: str) -> dict[str, Any]:
        kind = _kind(_OPENAI_TYPES, status, "internal_server_error")
        return {"error": {"message": message, "type": kind, "param": None, "code": str(status)}}

    def stream_error(self, status: int, message: str) -> bytes:
        return _sse(self.body(status, message)) + b"data: [DONE]\n\n"


@dataclass(frozen=True)
class AnthropicShape(Shape):
    name: str = "anthropic"

    def body(self, status: int, message: str) -> dict[str, Any]:
        return {"type": "error", "error": {"type": _kind(_ANTHROPIC_TYPES, status, "api_error"), "message": message}}

    def stream_error(self, status: int, message: str) -> bytes:
        return b"event: error\n" + _sse(self.body(status, message))  # Anthropic's stream has no [DONE]


@dataclass(frozen=True)
class OllamaShape(Shape):
    name: str = "ollama"
    delimiter: bytes = b"\n"  # NDJSON: one object a line

    def body(self, status: int, message: str) -> dict[str, Any]:
        return {"error": message}

    def stream_error(self, status: int, message: str) -> bytes:
        return json.dumps(self.body(status, message), ensure_ascii=False).encode() + b"\n"


OPENAI, ANTHROPIC, OLLAMA = Shape(), AnthropicShape(), OllamaShape()
_PREFIXES = (("/v1/messages", ANTHROPIC), ("/api/", OLLAMA))  # the first that matches; else OpenAI's


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def shape_for(path: str) -> Shape:
    return next((shape for prefix, shape in _PREFIXES if path.startswith(prefix)), OPENAI)


def error(status: int, message: str, path: str = "") -> JSONResponse:
    """An error answer in the shape of the API ``path`` belongs to (OpenAI's by default)."""
    return JSONResponse(shape_for(path).body(status, message), status_code=status)


def install(app: FastAPI, unsupported: dict[str, str] | None = None) -> None:
    """Unknown routes (404), wrong methods (405) and unexpected exceptions (500) in the shape
    of the path. ``unsupported``: paths this app does not serve -> why (their 404 says it)."""
    why = unsupported or {}

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and msg == "Not Found":
            msg = why.get(path, f"no such route: {path[:200]}")
        return JSONResponse(shape_for(path).body(exc.status_code, msg), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:  # Starlette logs it (re-raised)
        return error(500, f"internal router error: {type(exc).__name__}: {exc}", request.url.path)
