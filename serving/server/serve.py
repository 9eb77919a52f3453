"""Start the engine process, then uvicorn; stop both cleanly on SIGTERM / SIGINT.

The port is bound (and listened on) first, before the engine process starts: a port in use
fails at once with a clear message, without loading the model or opening the L3 store (which
may be the live server's). Connections made while the model loads wait in the backlog and
are served once the server is ready. uvicorn runs with edge/http_protocol.py's
connection class (h11 with read timeouts) and ``--limit-concurrency``. Once the warm-up
generation passed, one line on stdout says so, with the server's URL: SGLang's
``READY_MESSAGE`` followed by ``http://host:port`` (harness/server_utils.py waits for it).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

from common.tenants import load_tenants
from edge.http_protocol import REASONS, ReadTimeouts, protocol_class
from serving import ipc as m
from serving.server.app import create_app
from serving.server.config import AppConfig, read_chat_template
from serving.server.context import ServerContext
from serving.server.drain_api import drain
from serving.server.engine_client import EngineClient, EngineStartError
from serving.server.errors import error_body
from serving.server.metrics import ServerMetrics
from serving.server.req_handle import run_all
from serving.structs.sampling_params import SamplingParams
from serving.tokenizer import Tokenizer, has_tokenizer

READY_MESSAGE = "The server is fired up and ready to roll!"
log = logging.getLogger("hicache.server")


class _Uvicorn(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain is not None and self.loop is not None and not self.should_exit:
            run, self.drain, loop = self.drain, None, self.loop  # --drain-on-shutdown: drain, then stop
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain_then_exit(run)))
            return
        # uvicorn re-raises the signal after a graceful shutdown (so the exit status says
        # "killed"); a SIGTERM'd HiCache server shuts down and exits 0 instead.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    warmup: Callable[[], Awaitable[None]] | None = None
    url = ""  # printed on the ready line
    drain: Callable[[], Awaitable[dict]] | None = None  # --drain-on-shutdown (serving/server/drain_api.py)
    loop: asyncio.AbstractEventLoop | None = None
    failed = False

    async def _drain_then_exit(self, run: Callable[[], Awaitable[dict]]) -> None:
        try:
            r = await run()
            log.info("drained: %d pages written to L3 (%d on L3, %d not written), %d requests aborted",
                     r["written_pages"], r["l3_pages"], r["not_written"], r["aborted"])
        except Exception as e:
            log.error("the drain failed (%s: %s); shutting down", type(e).__name__, e)
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started and not self.should_exit:
            if self.warmup is not None:
                try:
                    await self.warmup()
                except Exception as e:
                    log.error("warm-up generation failed: %s", e)
                    self.should_exit = self.failed = True
                    return
            print(f"{READY_MESSAGE} {self.url}", flush=True)


async def _warmup(client: EngineClient) -> None:
    """One greedy token through the whole engine before announcing readiness (as SGLang does)."""
    req = m.GenerateReq(
        rid="warmup", input_ids=[0], sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0)
    )
    await run_all(client, [req])


def server_url(host: str, port: int) -> str:
    """The URL clients use: ``http://host:port`` (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _raise_interrupt(sig: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


class PortError(RuntimeError):
    pass


def listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A socket bound to ``host:port`` and listening (as uvicorn would make it), for uvicorn
    to serve on later; PortError naming the address if it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        hint = " (is another server running there? pick another --port)" if e.errno == errno.EADDRINUSE else ""
        raise PortError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    return sock


def run_server(cfg: AppConfig) -> int:
    """Blocks until the server is stopped; returns the process exit status."""
    level = cfg.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Until uvicorn installs its own handlers, SIGTERM interrupts the start like Ctrl-C does.
    try:
        sock = listen_socket(cfg.server.host, cfg.server.port)
    except PortError as e:
        log.error("%s; nothing was started (the model was not loaded)", e)
        return 1
    try:
        tenants = load_tenants(cfg.server.api_keys_file) if cfg.server.api_keys_file else None
    except ValueError as e:
        sock.close()
        log.error("%s; nothing was started", e)
        return 1
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    metrics = ServerMetrics()
    client = EngineClient(cfg.engine, cfg.server, metrics)
    try:
        client.spawn()
        model = cfg.engine.model
        tok_path = model.tokenizer_path or model.model_path
        tokenizer = Tokenizer(tok_path) if has_tokenizer(tok_path) else None
        if tokenizer is not None and cfg.server.chat_template:  # --chat-template (hicache serve checked it)
            tokenizer.hf.chat_template = read_chat_template(cfg.server.chat_template)
        info = client.wait_ready()
        log.info(
            "engine ready: %s, context %d, %d KV pages of %d tokens",
            info["model_path"],
            info["context_len"],
            info["num_pages"],
            info["page_size"],
        )
        ctx = ServerContext(cfg.engine, cfg.server, client, tokenizer, metrics, tenants)
        for reason in REASONS:  # each series from 0
            metrics.http_closed.labels(reason)
        timeouts = ReadTimeouts(cfg.server.header_timeout_s, cfg.server.body_timeout_s, cfg.server.body_idle_timeout_s)
        server = _Uvicorn(
            uvicorn.Config(
                create_app(ctx),
                host=cfg.server.host,
                port=cfg.server.port,
                http=protocol_class(timeouts, lambda reason: metrics.http_closed.labels(reason).inc(),
                                    lambda status, message, path: error_body(status, message), log,
                                    "hicache_http_connections_closed_total"),
                limit_concurrency=cfg.server.limit_concurrency,
                timeout_keep_alive=cfg.server.timeout_keep_alive,
                log_level=cfg.server.log_level,
                access_log=False,  # serving.server.access_log writes one (route templates, durations)
                lifespan="on",
                timeout_graceful_shutdown=cfg.server.graceful_shutdown_timeout_s,
            )
        )
        server.url = server_url(cfg.server.host, cfg.server.port)
        server.warmup = lambda: _warmup(client)
        if cfg.server.drain_on_shutdown:
            server.drain = lambda: drain(ctx, cfg.server.drain_timeout_s)

        def engine_gone() -> None:
            server.should_exit = server.failed = True

        client.on_gone = engine_gone
        signal.signal(signal.SIGTERM, previous)
        server.run(sockets=[sock])
        if not server.started or server.failed:
            return 1
    except EngineStartError as e:
        log.error("%s", e)
        return 2 if e.status == 400 else 1  # 2: a configuration this machine cannot serve
    except KeyboardInterrupt:
        log.info("interrupted while starting")
        return 130
    finally:
        sock.close()
        signal.signal(signal.SIGTERM, previous)
        code = client.stop(cfg.server.shutdown_timeout_s)
        if code == m.EXIT_BROKEN:
            log.error("engine process exited with code %s: its cache invariants broke after a failed step "
                      "(see the engine's log above)", code)
        elif code not in (0, None):
            log.warning("engine process exited with code %s", code)
    return 0 if code in (0, None) else 1
