"""A stand-in prefill or decode worker for the router's PD tests: a real uvicorn server on
127.0.0.1 that follows the worker-side PD contract (``/server_info`` with
``disaggregation_mode`` and ``disaggregation_bootstrap_port``; generation routes that take
``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room``), records what it received and
answers canned results. ``behavior`` scripts the next answers:

- ``ok`` (default): a prefill answers ``{"prefill": name}``; a decode answers JSON, or SSE
  events ``data: {"token": i, "worker": name, "room": room}`` and ``data: [DONE]``;
- ``error:STATUS``: an error with that status, at once;
- ``hang``: no answer until the client goes away (then ``disconnected`` is set);
- ``fail_once:STATUS``: that error once, then ``ok``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from router.embedded import free_port


class FakeWorker:
    def __init__(self, role: str, name: str, bootstrap_port: int = 8998) -> None:
        self.role, self.name, self.bootstrap_port = role, name, bootstrap_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.received: list[tuple[str, dict[str, Any]]] = []  # (path, body) of every POST
        self.auth: list[str | None] = []  # the Authorization header of every POST
        self.behavior = "ok"
        self.load = 0
        self.disconnected = threading.Event()
        self.server = uvicorn.Server(
            uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        )
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)

    def reset(self) -> None:
        self.received.clear()
        self.auth.clear()
        self.behavior, self.load = "ok", 0
        self.disconnected.clear()

    def generations(self) -> list[dict[str, Any]]:
        return [b for p, b in self.received if p in ("/generate", "/v1/completions", "/v1/chat/completions")]

    def start(self) -> FakeWorker:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, f"{self.name} did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def _next_behavior(self) -> str:
        b = self.behavior
        if b.startswith("fail_once:"):
            self.behavior = "ok"
            return "error:" + b.split(":", 1)[1]
        return b

    async def _hang(self, request: Request) -> Response:
        while not await request.is_disconnected():
            await asyncio.sleep(0.02)
        self.disconnected.set()
        return Response(status_code=499)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/server_info")
        async def server_info() -> dict[str, Any]:
            return {"disaggregation_mode": self.role, "disaggregation_bootstrap_port": self.bootstrap_port}

        @app.get("/get_load")
        async def get_load() -> dict[str, Any]:
            return {"load": self.load}

        @app.get("/get_model_info")
        async def model_info() -> dict[str, Any]:
            return {"tokenizer_path": None}

        async def generation(request: Request) -> Response:
            try:
                body = await request.json()
            except ClientDisconnect:  # abandoned by the router before its body was read
                self.disconnected.set()
                return Response(status_code=499)
            self.received.append((request.url.path, body))
            self.auth.append(request.headers.get("authorization"))
            behavior = self._next_behavior()
            if behavior.startswith("error:"):
                status = int(behavior.split(":")[1])
                return JSONResponse({"error": f"{self.name} says {status}"}, status_code=status)
            if behavior == "hang" and not body.get("stream"):
                return await self._hang(request)
            if self.role == "prefill":
                return JSONResponse({"prefill": self.name})
            room = body.get("bootstrap_room")
            if not body.get("stream"):
                return JSONResponse({"text": f"decoded by {self.name}", "room": room})

            async def events() -> Any:
                try:
                    while behavior == "hang" and not await request.is_disconnected():
                        await asyncio.sleep(0.02)
                    if behavior == "hang":
                        self.disconnected.set()
                        return
                    for i in range(3):
                        yield f"data: {json.dumps({'token': i, 'worker': self.name, 'room': room})}\n\n"
                        await asyncio.sleep(0.01)
                    yield "data: [DONE]\n\n"
                except asyncio.CancelledError:
                    self.disconnected.set()
                    raise

            return StreamingResponse(events(), media_type="text/event-stream")

        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.add_api_route(path, generation, methods=["POST"])

        async def admin(request: Request) -> Response:
            raw = await request.body()
            body = json.loads(raw) if raw else {}
            self.received.append((request.url.path, body))
            self.auth.append(request.headers.get("authorization"))
            if request.url.path == "/open_session":
                return JSONResponse(body.get("session_id") or f"{self.name}-session")
            return JSONResponse({"success": True})

        for path in ("/open_session", "/close_session", "/flush_cache"):
            app.add_api_route(path, admin, methods=["POST"])
        return app
