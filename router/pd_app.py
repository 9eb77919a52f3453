"""PD mode's router state (two worker pools) and its versions of the admin routes.

The generation routes are the app's own (router/app.py): their forwarder is a
:class:`~router.pd.PDForwarder`. Replaced here: ``/health`` (200 while a prefill and a decode
worker are available), ``/health_generate`` (one prefill and one decode worker, each on its
own), ``/get_load``, ``/list_workers`` (each worker with its ``role``), ``/flush_cache`` (both
sets), ``/open_session`` (on a prefill and a decode worker; the router names the session when
the client does not, so both sides share the id) and ``/close_session`` (on both),
``/add_worker`` (``role=prefill|decode``, else the worker's ``disaggregation_mode``; optional
``bootstrap_port``) and ``/remove_worker``.

Each worker's ``/server_info`` (``disaggregation_mode``, ``disaggregation_bootstrap_port``) is
read once it answers, again after its circuit opened (a restart may change it); a worker whose
mode is not its role here is logged as a warning.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from contextlib import suppress
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common.json_depth import too_deep
from router.bodies import json_object, too_deep_message
from router.errors import error
from router.pd import PDForwarder
from router.policies import RouteRequest
from router.state import RouterState
from router.tenancy import scope_of, session_key
from router.urls import ROUTER_ID_HEADER, check_not_self, check_url, normal_url
from router.workers import Worker, WorkerPool

log = logging.getLogger("hicache.router")
ROLES = ("prefill", "decode")
INFO_KEYS = ("disaggregation_mode", "disaggregation_bootstrap_port")
PD_PATHS = frozenset({"/health", "/health_generate", "/get_load", "/list_workers", "/flush_cache", "/open_session",
                      "/close_session", "/add_worker", "/remove_worker"})


class PDRouterState(RouterState):
    """``pool`` (with ``policy`` and the cache view) holds the prefill workers, ``decode`` the others."""

    forwarder: PDForwarder

    def make_forwarder(self) -> PDForwarder:
        self.decode = WorkerPool(self.cfg, self.client, self.worker_headers, self.router_id)
        for pool in (self.pool, self.decode):
            pool.on_reset.append(lambda url, pool=pool: self._unlearn(pool, url))
        return PDForwarder(self.cfg, self.pool, self.decode, self.policy, self.client, self.worker_headers)

    def pools(self) -> tuple[tuple[str, WorkerPool], ...]:
        return ("prefill", self.pool), ("decode", self.decode)

    async def start(self) -> None:
        for url, _ in self.cfg.prefill_urls:
            self.pool.add(url)
        for url in self.cfg.decode_urls:
            self.decode.add(url)
        await self.decode.check_health()
        await super().start()  # the prefill side: health, tokenizer, background loops
        self.decode.start()
        await self.learn_all()
        self._learner = asyncio.create_task(self._learn_loop())

    async def stop(self) -> None:
        self._learner.cancel()
        with suppress(asyncio.CancelledError):
            await self._learner
        await self.decode.stop()
        await self.forwarder.stop()
        await super().stop()

    # -- the workers' /server_info -------------------------------------------------------------
    async def fetch_info(self, url: str) -> dict[str, Any] | None:
        for path in ("/server_info", "/get_server_info"):
            try:
                r = await self.client.get(
                    url + path, headers=self.worker_headers, timeout=self.cfg.health_check_timeout_s
                )
                info = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None
            if isinstance(info, dict):
                nested = info.get("server") if isinstance(info.get("server"), dict) else {}
                return {k: info.get(k, nested.get(k)) for k in INFO_KEYS}
        return None

    async def learn(self, w: Worker, role: str) -> None:
        info = await self.fetch_info(w.url)
        if info is None:
            return
        w.info = info
        if info["disaggregation_mode"] != role:
            log.warning("worker %s is a %s worker here, but its disaggregation_mode is %r",
                        w.url, role, info["disaggregation_mode"])

    async def learn_all(self) -> None:
        await asyncio.gather(*(self.learn(w, role) for role, pool in self.pools()
                               for w in list(pool.workers.values()) if not w.info and w.healthy))

    async def _learn_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_check_interval_s)
            with suppress(Exception):
                await self.learn_all()

    @staticmethod
    def _unlearn(pool: WorkerPool, url: str) -> None:
        if url in pool.workers:
            pool.workers[url].info = {}

    def describe(self, w: Worker, role: str) -> dict[str, Any]:
        v = {**w.view(), "role": role, "disaggregation_mode": w.info.get("disaggregation_mode")}
        if role == "prefill":
            v["bootstrap_port"] = self.forwarder.bootstrap_port(w)
        return v


async def _args(request: Request, max_depth: int) -> dict[str, Any] | Response:
    """Query parameters, then a JSON object body's keys (a 400 for a body nested too deeply)."""
    out: dict[str, Any] = dict(request.query_params)
    raw = await request.body()
    if too_deep(raw, max_depth):
        return error(400, too_deep_message(max_depth), request.url.path)
    with suppress(ValueError, RecursionError):  # not JSON: the query's parameters only
        body = json.loads(raw or b"{}")
        if isinstance(body, dict):
            out.update(body)
    return out


def _first_error(answers: list[Response]) -> Response:
    return next((a for a in answers if a.status_code != 200), answers[-1])


def add_pd_routes(app: FastAPI, state: PDRouterState) -> None:
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in PD_PATHS]
    fwd = state.forwarder

    def pair(sid: str | None) -> tuple[Worker, Worker] | Response:
        prefill, decode = state.pool.available(), state.decode.available()
        if not prefill or not decode:
            return error(503, "no " + ("prefill" if not prefill else "decode") + " worker is available")
        return state.policy.select(RouteRequest("", None, sid), prefill), fwd.least_loaded(decode)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.pool.available() and state.decode.available() else 503,
                        headers={ROUTER_ID_HEADER: state.router_id})  # so it never takes itself as a worker

    @app.api_route("/health_generate", methods=["GET", "POST"])
    async def health_generate(request: Request) -> Response:
        ws = pair(None)
        if isinstance(ws, Response):
            return ws
        body = await request.body() if request.method == "POST" else None
        headers = state.headers(request)
        return _first_error(list(await asyncio.gather(*(fwd.call(w, request.method, "/health_generate", body, headers)
                                                        for w in ws))))

    @app.get("/get_load")
    async def get_load() -> dict[str, Any]:
        loads = {role: {w.url: w.load for w in pool.workers.values()} for role, pool in state.pools()}
        return {"workers": {**loads["prefill"], **loads["decode"]}, **loads}

    @app.get("/list_workers")
    async def list_workers() -> dict[str, Any]:
        return {
            "policy": state.cfg.policy,
            "cache_view": state.cfg.cache_view,
            "pd_disaggregation": True,
            "workers": [state.describe(w, role) for role, pool in state.pools() for w in pool.workers.values()],
            "sessions": len(fwd.sessions.owner.keys() | fwd.decode_sessions.owner.keys()),
            "policy_stats": state.policy.stats(),
        }

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        headers = fwd.headers_for(request.headers)
        workers = state.pool.available() + state.decode.available()
        answers = await asyncio.gather(*(fwd.call(w, "POST", "/flush_cache", None, headers) for w in workers))
        for w in state.pool.available():
            state.policy.forget(w.url)
        ok = all(a.status_code == 200 for a in answers)
        return JSONResponse(
            {"success": ok, "workers": {w.url: a.status_code for w, a in zip(workers, answers, strict=True)}},
            status_code=200 if ok else 502,
        )

    @app.post("/open_session")
    async def open_session(request: Request) -> Response:
        raw = await request.body()
        body = json_object(raw, "/open_session", state.cfg.max_json_depth) if raw.strip() else {}
        if not isinstance(body, dict):
            return body
        sid = body.setdefault("session_id", uuid.uuid4().hex)  # one id for both sides
        key = session_key(scope_of(getattr(request.state, "tenant", None), {}), sid if isinstance(sid, str) else None)
        ws = pair(key)
        if isinstance(ws, Response):
            return ws
        raw, headers = json.dumps(body).encode(), state.headers(request)  # a tenant's key goes on as it came
        answers = await asyncio.gather(*(fwd.call(w, "POST", "/open_session", raw, headers) for w in ws))
        if all(a.status_code == 200 for a in answers):
            fwd.sessions.owner[key], fwd.decode_sessions.owner[key] = ws[0].url, ws[1].url
            return answers[1]
        close = json.dumps({"session_id": sid}).encode()  # undo the side that opened it
        for w, a in zip(ws, answers, strict=True):
            if a.status_code == 200:
                await fwd.call(w, "POST", "/close_session", close, headers)
        return _first_error(answers)

    @app.post("/close_session")
    async def close_session(request: Request) -> Response:
        raw = await request.body()
        args = await _args(request, state.cfg.max_json_depth)
        if isinstance(args, Response):
            return args
        sid = args.get("session_id")
        if not isinstance(sid, str):
            return error(400, "the body must be a JSON object with session_id")
        key = session_key(scope_of(getattr(request.state, "tenant", None), {}), sid)  # another tenant's: unknown
        owners = ((fwd.sessions, state.pool), (fwd.decode_sessions, state.decode))
        ws = [pool.workers[url] for sessions, pool in owners if (url := sessions.owner.pop(key, None)) in pool.workers]
        if not ws:
            return error(404, f"unknown session {sid!r}")
        headers = state.headers(request)
        return _first_error(list(await asyncio.gather(*(fwd.call(w, "POST", "/close_session", raw, headers)
                                                        for w in ws))))

    @app.post("/add_worker")
    async def add_worker(request: Request) -> Response:
        args = await _args(request, state.cfg.max_json_depth)
        if isinstance(args, Response):
            return args
        try:
            url = check_not_self(check_url(args.get("url") if isinstance(args.get("url"), str) else ""),
                                 state.cfg.host, state.cfg.port)
        except ValueError as e:
            return error(400, str(e))
        if await state.pool.is_this_router(url):
            return error(400, f"worker url {url} is this router itself (its /health answered with this router's "
                              "id): a router cannot be its own worker")
        info = await state.fetch_info(url)
        role = args.get("role") or args.get("worker_type") or (info or {}).get("disaggregation_mode")
        if role not in ROLES:
            return error(400, f"give role=prefill or role=decode for {url} (its disaggregation_mode: {role!r})")
        port = args.get("bootstrap_port")
        if port is not None and not str(port).isdigit():
            return error(400, f"bootstrap_port must be a port number, got {port!r}")
        pools = dict(state.pools())
        if url in pools["decode" if role == "prefill" else "prefill"].workers:
            return error(400, f"{url} is already a worker of the other role; remove it first")
        w = pools[role].add(url)
        w.info = info or {}
        if role == "prefill" and port is not None:
            fwd.ports[url] = int(port)
        await pools[role].check_one(w)
        return JSONResponse({"success": True, "worker": state.describe(w, role)})

    @app.post("/remove_worker")
    async def remove_worker(request: Request) -> Response:
        args = await _args(request, state.cfg.max_json_depth)
        if isinstance(args, Response):
            return args
        url = normal_url(args.get("url") if isinstance(args.get("url"), str) else "")
        if not any(pool.remove(url) for _, pool in state.pools()):
            return error(404, f"no worker {url!r}")
        fwd.ports.pop(url, None)
        return JSONResponse({"success": True})
