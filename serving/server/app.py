"""The FastAPI application: routers, error handlers, API-key check."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.server import admin_api, errors, native_api, openai_api
from serving.server.context import ServerContext

OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """401 unless ``Authorization: Bearer <api_key>``; /health stays open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        body = json.dumps(
            errors.error_body(401, "missing or invalid API key (send Authorization: Bearer <key>)")
        )
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})


def create_app(ctx: ServerContext) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.client.attach(asyncio.get_running_loop())
        yield

    app = FastAPI(title="HiCache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    errors.install(app)
    for module in (openai_api, native_api, admin_api):
        app.include_router(module.router)
    if ctx.server.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=ctx.server.api_key)
    return app
