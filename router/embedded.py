"""Run a router inside this process, on its own thread and event loop (tests, benchmarks,
embedding). ``with RouterThread(cfg) as r: httpx.get(r.url + "/health")``. It reads connections
as ``hicache router`` does (router/connections.py: read timeouts, framing guard) and counts the
ones it closed, by reason, in ``connections_closed`` (written on the router's loop only)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import uvicorn

from router.app import create_app
from router.config import RouterConfig
from router.connections import protocol_class
from router.state import RouterState


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RouterThread:
    def __init__(self, cfg: RouterConfig) -> None:
        if cfg.port == RouterConfig.port:
            cfg = replace(cfg, port=free_port(cfg.host))
        self.cfg = cfg
        self.url = f"http://{cfg.host}:{cfg.port}"
        self.app = create_app(cfg)
        self.connections_closed: Counter[str] = Counter()  # reason (edge.http_protocol.REASONS) -> count
        logging.getLogger("httpx").setLevel(logging.WARNING)

        def count(reason: str) -> None:
            self.connections_closed[reason] += 1

        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host=cfg.host, port=cfg.port, http=protocol_class(cfg, count),
                           log_level="warning", lifespan="on", timeout_keep_alive=cfg.timeout_keep_alive)
        )
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.server.run, name="router", daemon=True)

    @property
    def state(self) -> RouterState:
        return self.app.state.router

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the router's loop (its state is not thread-safe); return the result."""
        return asyncio.run_coroutine_threadsafe(_call(fn, *args), self.state.loop).result(30)

    def start(self, timeout: float = 60.0) -> RouterThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the router did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self) -> RouterThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


async def _call(fn: Any, *args: Any) -> Any:
    out = fn(*args)
    if asyncio.iscoroutine(out):
        out = await out
    return out
