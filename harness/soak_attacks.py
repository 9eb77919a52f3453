"""The soak's attacks of issue 42 (tests/server/test_soak.py), beside harness/soak_mix.py's mix: tenants
trying the admin routes of the worker and of a router in front of it, 20 MB bodies sent to the router,
floods of 1 h ``cache_control`` breakpoints, slowloris connections to both, and a prompt of ~7.8k tokens
beside short requests. Each records its answers in the :class:`~harness.soak_mix.Mix` by kind; the test
judges them.

Kinds and what each answer must be:
- ``tenant_admin``: 403 (bob's key on ``/drain``, ``/undrain``, ``/flush_cache``, ``/metrics``,
  ``/get_server_info`` of the worker; ``/add_worker``, ``/remove_worker``, ``/flush_cache``,
  ``/list_workers`` of the router);
- ``router_huge``: 413 (a 20 MB body; the router refuses it before it reads it all or keys it);
- ``routed``: 200 (alice's short request through the router, after each huge body);
- ``breakpoint``: 200, and the usage says what became of the breakpoint: created, read, or not
  pinned with a reason (never a 429, never a silent 0);
- ``slowloris``: the server closed the connection (408 or a bare close) while the client still
  trickled its head; ``Mix.notes["slowloris_closed_s"]`` has how long each took;
- ``long``: 200 for the long prompt; ``beside_long``: 200 for each short request sent while it is
  prefilled, their latencies in ``Mix.notes["beside_long_s"]``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from harness.soak_mix import Mix

ADMIN, ALICE, BOB = "soak-admin-key-01", "sk-soak-alice-01", "sk-soak-bobby-01"
KEYS = {"salt_secret": "a-soak-secret-of-some-length", "keys": {ALICE: "alice", BOB: "bob"}}
HUGE_BODY_MB = 20
LONG_TOKENS = 7_800
SLOW_CONNECTIONS = 25  # to each of the worker and the router
SLOW_BYTE_EVERY_S = 1.0


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class Target:
    """Where the attacks go: the worker and the router in front of it."""

    worker: str
    router: str


async def tenant_admin(t: Target, mix: Mix) -> None:
    """Bob's key on every admin route, of the worker and of the router, over and over: each a 403."""
    worker = [("POST", "/drain", {"timeout_s": 0}), ("POST", "/undrain", None), ("POST", "/flush_cache", None),
              ("GET", "/metrics", None), ("GET", "/get_server_info", None)]
    router = [("POST", f"/add_worker?url=http://127.0.0.1:{urlsplit(t.router).port + 1}", None),
              ("POST", f"/remove_worker?url={t.worker}", None), ("POST", "/flush_cache", None),
              ("GET", "/list_workers", None)]
    async with httpx.AsyncClient(headers=auth(BOB), timeout=60) as c:
        while mix.active():
            for base, routes in ((t.worker, worker), (t.router, router)):
                for method, path, body in routes:
                    t0 = time.monotonic()
                    r = await c.request(method, base + path, json=body)
                    await mix.add_response("tenant_admin", r, t0)
            await asyncio.sleep(0.5)


async def _huge_post(url: str, key: str) -> int:
    """POST a 20 MB /generate body, chunked (no length to refuse it by: the router counts the bytes),
    over a raw socket that reads while it writes (a server that answers early and closes resets
    the connection; its answer was read before): the answer's status (0: none came)."""
    u = urlsplit(url)
    loop = asyncio.get_running_loop()
    sock = socket.create_connection((u.hostname, u.port))
    sock.setblocking(False)
    head = (f"POST /generate HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()

    async def send() -> None:
        await loop.sock_sendall(sock, head)
        piece = b"word " * (2**20 // 5)
        for i in range(HUGE_BODY_MB + 2):
            data = b'{"text": "' if i == 0 else piece if i <= HUGE_BODY_MB else b'"}'
            await loop.sock_sendall(sock, b"%x\r\n%b\r\n" % (len(data), data))
        await loop.sock_sendall(sock, b"0\r\n\r\n")

    sender = asyncio.ensure_future(send())
    try:
        answer = await asyncio.wait_for(loop.sock_recv(sock, 4096), 120)
    except ConnectionError:
        answer = b""
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        sock.close()
    return int(answer.split()[1]) if answer.startswith(b"HTTP/1.1 ") else 0


async def router_bodies(t: Target, mix: Mix) -> None:
    """A 20 MB body to the router (a 413), then alice's short request through it (a 200)."""
    async with httpx.AsyncClient(headers=auth(ALICE), timeout=120) as c:
        while mix.active():
            t0 = time.monotonic()
            mix.add("router_huge", await _huge_post(t.router, ALICE), t0)
            t0 = time.monotonic()
            r = await c.post(t.router + "/generate", json={"text": f"Routed {t0:.3f}: the capital of France is",
                                                           "sampling_params": {"max_new_tokens": 4}})
            await mix.add_response("routed", r, t0)
            await asyncio.sleep(1.0)


async def breakpoints(t: Target, mix: Mix) -> None:
    """Alice and bob each send 1 h breakpoints of ~40 pages, new ones every time: never a 429;
    each answer says what became of its breakpoint."""
    n = 0

    async def one(c: httpx.AsyncClient, who: str) -> None:
        nonlocal n
        n += 1
        text = f"{who}'s agent {n} reads its notes. " + f"The notes say many things about item {n}. " * 60
        body = {"model": "m", "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]}
        t0 = time.monotonic()
        r = await c.post(t.worker + "/v1/messages", json=body)
        await mix.add_response("breakpoint", r, t0)
        if r.status_code == 200:
            u = r.json()["usage"]
            said = (u["cache_creation_input_tokens"] > 0 or u["cache_read_input_tokens"] > 0
                    or bool(u.get("cache_control", {}).get("not_pinned")))
            if not said:
                mix.add("breakpoint", 299, t0, json.dumps(u)[:300])  # a silent 0: the test fails on 299

    async with httpx.AsyncClient(headers=auth(ALICE), timeout=120) as a, \
            httpx.AsyncClient(headers=auth(BOB), timeout=120) as b:
        while mix.active():
            await asyncio.gather(one(a, "alice"), one(b, "bob"))
            await asyncio.sleep(0.2)


async def _trickle(url: str, mix: Mix, closed: list[float]) -> None:
    """One slowloris connection: a request head a byte a second, until the server closes it."""
    u = urlsplit(url)
    head = (f"POST /generate HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\nX-Padding: " + "a" * 4000).encode()
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    status = 0
    try:
        for i in range(len(head)):
            writer.write(head[i:i + 1])
            try:
                await writer.drain()
                data = await asyncio.wait_for(reader.read(64), SLOW_BYTE_EVERY_S)
            except asyncio.TimeoutError:
                continue
            except ConnectionError:
                data = b""
            status = int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else 499
            break
        else:
            status = 0  # the whole head went through: never closed
    finally:
        writer.close()
    closed.append(round(time.monotonic() - t0, 1))
    mix.add("slowloris", status if status else 0, t0)


async def slowloris(t: Target, mix: Mix) -> None:
    """Waves of slowloris connections to the worker and to the router while the mix runs."""
    closed: list[float] = mix.notes.setdefault("slowloris_closed_s", [])
    while mix.active():
        await asyncio.gather(*(_trickle(url, mix, closed) for url in (t.worker, t.router)
                               for _ in range(SLOW_CONNECTIONS)))
        await asyncio.sleep(1.0)


async def long_prompt(t: Target, mix: Mix, short_every_s: float = 0.05) -> None:
    """A ~7.8k-token prompt, and short requests sent while it is prefilled: their latencies."""
    lat: list[float] = mix.notes.setdefault("beside_long_s", [])
    ids = [(37 * i) % 30_000 + 100 for i in range(LONG_TOKENS)]
    async with httpx.AsyncClient(headers=auth(ALICE), timeout=300) as c:
        while mix.active():
            ids = [ids[-1] + 1 if ids[-1] < 30_000 else 100] + ids[1:]  # a fresh first page: no hit
            t0 = time.monotonic()
            task = asyncio.ensure_future(c.post(t.worker + "/generate", json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": 1}}))
            while not task.done():
                await asyncio.sleep(short_every_s)
                t1 = time.monotonic()
                r = await c.post(t.worker + "/generate", json={
                    "text": f"Short {t1:.3f}", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
                await mix.add_response("beside_long", r, t1)
                lat.append(round(time.monotonic() - t1, 3))
            await mix.add_response("long", task.result(), t0)


ATTACKS = (tenant_admin, router_bodies, breakpoints, slowloris, long_prompt)
