"""Errors in OpenAI's JSON shape, and the handlers that make every failure one of them.

``{"error": {"message", "type", "param", "code"}}`` for every status; FastAPI's 422 for a
bad body becomes a 400 that names the field; unknown routes are 404s in the same shape.

An error never echoes a client's input whole: a value a message quotes (a model name, a field
name) shows at most ``ECHO_CHARS`` characters (``quoted``), and every message is cut at
``MESSAGE_CHARS`` (``clip``, in ``APIError`` and ``error_body``), so a 1 MB ``model`` is not sent back.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("hicache.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "service_unavailable",
    504: "timeout_error",
}


ECHO_CHARS = 200  # of a client's value quoted in an error message
MESSAGE_CHARS = 1000  # of an error message in all

_UNION_TAGS = {"str", "int", "float", "bool", "none", "function-after", "function-before"}


def clip(text: str, limit: int = MESSAGE_CHARS) -> str:
    """``text``, or its first characters and "... (N characters)" (at most ``limit`` in all)."""
    if len(text) <= limit:
        return text
    tail = f"... ({len(text)} characters)"
    return text[: max(limit - len(tail), 0)] + tail


def quoted(value: object, limit: int = ECHO_CHARS) -> str:
    """A client's value for an error message: its repr, cut to about ``limit`` characters."""
    text = value if isinstance(value, str) else str(value)
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


class APIError(Exception):
    """An error the API answers with; ``status`` is the HTTP status; the message is clipped."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None
    ) -> None:
        message, param = clip(message), None if param is None else clip(param, ECHO_CHARS)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape; ``kind`` (its ``type``) defaults to one per status."""
    kind = kind or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {
        "error": {"message": clip(message), "type": kind, "param": None if param is None else clip(param, ECHO_CHARS),
                  "code": code if code else str(status)}
    }


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, kind), status_code=status)


def validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """A readable message from pydantic errors, naming the field; and the top-level param."""
    parts, param = [], None
    for e in errors[:4]:
        loc = [  # a field name can be the client's (an unknown one): cut, as every echo is
            clip(str(x), ECHO_CHARS)
            for x in e.get("loc", ())
            if x != "body" and str(x) not in _UNION_TAGS and "[" not in str(x)
        ]
        msg = str(e.get("msg", "invalid value"))
        if e.get("type") == "value_error":  # our own validators: "field: what is wrong"
            msg = msg.removeprefix("Value error, ")
            head = msg.split(":", 1)[0]
            if not loc and head.isidentifier():
                loc = [head]
                msg = msg.split(":", 1)[1].strip()
        elif e.get("type") == "extra_forbidden":
            msg = "unknown or unsupported field"
        if loc and param is None:
            param = loc[0]
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return "; ".join(parts), param


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.kind)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> JSONResponse:  # not an error: nothing logged
        return error_response(499, "the client closed the connection")

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = validation_message(list(exc.errors()))
        return error_response(400, msg, param)

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        msg, param = validation_message(list(exc.errors()))
        return error_response(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and msg == "Not Found":
            msg = "no such route"
        return error_response(exc.status_code, msg)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
