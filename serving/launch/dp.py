"""``hicache serve --dp-size N``: N engine replicas behind the built-in cache-aware router, in
one command (as SGLang users run ``--dp-size``).

Each replica is a whole ``hicache serve`` (its own HTTP process and engine, ``--tp-size`` ranks
each) started from the same command line on the first free ports above ``--port``; on CUDA
replica ``i`` starts at GPU ``i * tp_size``. They share the configured L3 (the same LMDB directory or Mooncake
store), so a prefix one replica wrote is an L3 hit on the others. The router
(``router/``) listens on ``--host``/``--port``, routes by cached prefix over HTTP, and is what
clients talk to. A replica that fails to start stops the others; SIGTERM stops the router, then
the replicas (each persists its cache to L3 first).
"""

from __future__ import annotations

import http.client
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

log = logging.getLogger("hicache.dp")
START_TIMEOUT_S = 600.0


def replica_ports(after: int, n: int) -> tuple[list[int], list[socket.socket]]:
    """``n`` ports above ``after`` (the router's) that nothing uses now, and sockets bound to them
    (SO_REUSEADDR, not listening) for the caller to hold until the replicas listen there: no
    outgoing connection or plain bind can take one meanwhile, and a replica's own listening socket
    (SO_REUSEADDR too) can still bind it. Counting up from the server's port, as SGLang places
    its workers' ports, keeps them out of the kernel's ephemeral range for the usual ports (30000)."""
    ports: list[int] = []
    holds: list[socket.socket] = []
    port = after
    while len(ports) < n:
        port += 1
        if port > 65535:
            for h in holds:
                h.close()
            raise RuntimeError(f"--dp-size {n}: no {n} free ports above {after}")
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        ports.append(port)
        holds.append(s)
    return ports, holds


def replica_args(argv: list[str], cfg, i: int, port: int) -> list[str]:  # noqa: ANN001 - AppConfig
    """The replica's command line: the user's flags, then ours (argparse: the last one wins)."""
    from serving.runner.model_runner import resolve_device

    extra = ["--dp-size", "1", "--host", "127.0.0.1", "--port", str(port)]
    dev = resolve_device(cfg.engine.model.device)
    if dev.type == "cuda":
        extra += ["--device", f"cuda:{(dev.index or 0) + i * cfg.engine.model.tp_size}"]
    return [sys.executable, "-m", "serving.launch.cli", "serve", *argv, *extra]


def _wait_healthy(procs: list[subprocess.Popen], urls: list[str], headers: dict[str, str]) -> str | None:
    """None once every replica answers /health with 200; else why not."""
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(range(len(urls)))
    while pending:
        for i in list(pending):
            if procs[i].poll() is not None:
                return f"data-parallel replica {i} exited with code {procs[i].returncode} while starting"
            try:
                with urllib.request.urlopen(urllib.request.Request(urls[i] + "/health", headers=headers),
                                            timeout=2) as r:
                    if r.status == 200:
                        pending.discard(i)
            except (OSError, http.client.HTTPException):  # URLError/HTTPError (non-2xx) are OSErrors
                pass
        if time.monotonic() > deadline:
            return f"data-parallel replicas {sorted(pending)} not ready after {START_TIMEOUT_S:.0f} s"
        time.sleep(0.25)
    return None


def _stop(procs: list[subprocess.Popen], timeout: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_dp(cfg, argv: list[str]) -> int:  # noqa: ANN001 - serving.server.config.AppConfig
    from router.cli import serve
    from router.config import RouterConfig

    logging.basicConfig(level=cfg.server.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    n = cfg.server.dp_size
    if cfg.engine.model.tp_size > 1:  # the replicas would each fail on it: say so once, before starting them
        from serving.models.arch_config import ModelArchConfig
        from serving.parallel.shard import ShardPlan, TPShapeError

        try:
            ShardPlan.for_model(ModelArchConfig.from_pretrained(cfg.engine.model.model_path), 0,
                                cfg.engine.model.tp_size)
        except TPShapeError as e:
            print(f"hicache serve: {e}", file=sys.stderr)
            return 2
    ports, holds = replica_ports(cfg.server.port, n)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen(replica_args(argv, cfg, i, port), env=env) for i, port in enumerate(ports)]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM while replicas start: stop them
    try:
        key = cfg.server.api_key or os.environ.get("HICACHE_API_KEY")
        try:
            why = _wait_healthy(procs, urls, {"Authorization": f"Bearer {key}"} if key else {})
        finally:
            for h in holds:  # the replicas listen on them now (or have failed)
                h.close()
        if why is not None:
            print(f"hicache serve: {why}; stopping", file=sys.stderr, flush=True)
            return 1
        log.info("data parallelism: %d replicas at %s behind the router on %s:%d", n, " ".join(urls),
                 cfg.server.host, cfg.server.port)
        # the router takes the replicas' keys and request limits, so clients see one server
        rcfg = RouterConfig(host=cfg.server.host, port=cfg.server.port, worker_urls=tuple(urls),
                            api_key=key, api_keys_file=cfg.server.api_keys_file, log_level=cfg.server.log_level,
                            allowed_hosts=cfg.server.allowed_hosts, max_request_bytes=cfg.server.max_request_bytes,
                            max_json_depth=cfg.server.max_json_depth)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # uvicorn installs its own handler
        return serve(rcfg)
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(procs, cfg.server.shutdown_timeout_s + 10)
