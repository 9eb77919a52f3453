"""The soak test's traffic (tests/server/test_soak.py): a canary that sends one short greedy /generate every
``CANARY_EVERY_S``, bursts of 100 streams of which about half disconnect after a few tokens, the
abusers (pathological and self-recursive grammars, prompts over the context, 10,000-deep JSON,
broken bodies, wrong content types, an unknown model, requests aborted right after they start),
and the processes' memory sampled meanwhile. :class:`Mix` records every answer; the test scripts
its own events (``run_mix(..., events=...)``) and judges the record.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from harness.server_utils import ServerProcess, proc_status

CANARY_EVERY_S = 0.5
CANARY = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
STALL = "the engine has made no progress"  # the watchdog's 503 message
NO_WORKER = "no worker is available"  # a router's 503 while its only worker is stalled (its /health 503)
ROUTER_HEALTH_S = 1.0  # the soak router's health_check_interval_s and circuit_cooldown_s
MB = 2**20
RECURSIVE_SCHEMA = json.dumps({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                               "required": ["c"]}}, "$ref": "#/$defs/n"})


class Mix:
    """What one run records: answers by kind as (status, sent, answered, 5xx message), the
    canary's (sent, answered), the stall window, and the scripted events' state."""

    def __init__(self, soak_s: float, scripted: bool) -> None:
        self.deadline = time.monotonic() + soak_s
        self.events_done = not scripted
        self.abuse_done = False
        self.answers: dict[str, list[tuple[int, float, float, str]]] = {}
        self.canary: list[tuple[float, float]] = []
        self.window: tuple[float, float] | None = None  # SIGSTOP .. /health 200 again
        self.notes: dict[str, Any] = {}
        self.pause_streams = False  # no new burst while set (the session flood)
        self.no_burst = asyncio.Event()  # set while no burst of streams is in flight

    def active(self) -> bool:
        return time.monotonic() < self.deadline or not self.events_done

    def add(self, kind: str, status: int, sent: float, message: str = "") -> None:
        self.answers.setdefault(kind, []).append((status, sent, time.monotonic(), message))

    async def add_response(self, kind: str, r: httpx.Response, sent: float) -> None:
        self.add(kind, r.status_code, sent, await message(r) if r.status_code >= 500 else "")

    def allowed_503(self, status: int, sent: float, answered: float, message: str) -> bool:
        w = self.window
        if status != 503 or w is None or answered < w[0]:
            return False
        # a router takes the worker back at a health check after its circuit's cooldown (both ROUTER_HEALTH_S)
        return (STALL in message and sent < w[1]) or (NO_WORKER in message and sent < w[1] + 3 * ROUTER_HEALTH_S)

    def codes(self, kind: str) -> set[int]:
        """The statuses of ``kind``'s answers, the allowed 503s left out."""
        return {c for c, t0, t1, msg in self.answers.get(kind, []) if not self.allowed_503(c, t0, t1, msg)}


async def message(r: httpx.Response) -> str:
    await r.aread()
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:300]


async def canary(client: httpx.AsyncClient, mix: Mix) -> None:
    while not mix.abuse_done:
        t0 = time.monotonic()
        r = await client.post("/generate", json=CANARY, timeout=120)
        await mix.add_response("canary", r, t0)
        mix.canary.append((t0, time.monotonic()))
        await asyncio.sleep(max(0.0, CANARY_EVERY_S - (time.monotonic() - t0)))


async def stream(client: httpx.AsyncClient, rng: random.Random, mix: Mix) -> None:
    drop = rng.random() < 0.5
    body = {"text": f"story {rng.random()}", "stream": True,
            "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0.7}}
    t0 = time.monotonic()
    async with client.stream("POST", "/generate", json=body, timeout=120) as r:
        await mix.add_response("stream", r, t0)
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: ")
            if drop and n >= 3:
                return  # the client goes away mid-stream: the server aborts the request


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **kw}


async def abuse(client: httpx.AsyncClient, rng: random.Random, mix: Mix) -> None:
    deep = "[" * 10_000 + "]" * 10_000
    gen = "/generate"
    bad = [
        ("regex", gen, dict(json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "regex": "(a|b)*" * 2000}})),
        ("schema", gen, dict(json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "json_schema": json.dumps(
            {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "(a|b)*" * 50}
                                              for i in range(200)}})}})),
        ("recursive", gen, dict(json={"text": "Hi", "sampling_params": {"max_new_tokens": 8,
                                                                        "json_schema": RECURSIVE_SCHEMA}})),
        ("recursive", gen, dict(json={"text": "Hi", "sampling_params": {"max_new_tokens": 8,
                                                                        "ebnf": 'root ::= "ab" root'}})),
        ("recursive", "/v1/chat/completions", dict(json=chat_body(response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": json.loads(RECURSIVE_SCHEMA)}}))),
        ("huge", gen, dict(json={"text": "word " * 60_000, "sampling_params": {"max_new_tokens": 2}})),
        ("deep", gen, dict(content=f'{{"text": "x", "sampling_params": {deep}}}',
                           headers={"Content-Type": "application/json"})),
        ("broken", gen, dict(content=b'{"text": "x", ', headers={"Content-Type": "application/json"})),
        ("types", gen, dict(json={"text": 5, "sampling_params": {"max_new_tokens": "many"}})),
        ("plain", gen, dict(content=b'{"text": "x"}', headers={"Content-Type": "text/plain"})),
    ]
    while mix.active():
        kind, path, kw = rng.choice(bad)
        t0 = time.monotonic()
        await mix.add_response(kind, await client.post(path, timeout=120, **kw), t0)
        t0 = time.monotonic()
        await mix.add_response("model", await client.post("/v1/chat/completions", timeout=120,
                                                          json={**chat_body(), "model": "gpt-4"}), t0)
        if rng.random() < 0.3:  # started, then aborted right away (the client gives up)
            try:
                await client.post("/generate", timeout=0.05, json={
                    "text": f"abort me {rng.random()}", "sampling_params": {"max_new_tokens": 200}})
            except httpx.TimeoutException:
                pass


# -- memory ---------------------------------------------------------------------------------------
async def sample_memory(pids: dict[str, int], mix: Mix) -> None:
    """Each process's peak VmRSS (MB) in ``Mix.notes["sampled_rss_mb"]``; for ``pids["router"]``, also
    its children's (the key processes, which it may replace), the largest as ``"key_process"``."""
    peaks = mix.notes.setdefault("sampled_rss_mb", dict.fromkeys(pids, 0))
    while not mix.abuse_done:
        for name, pid in pids.items():
            peaks[name] = max(peaks[name], proc_status(pid)["VmRSS"] // MB)
        for kid in children(pids["router"]) if "router" in pids else []:
            try:
                peaks["key_process"] = max(peaks.get("key_process", 0), proc_status(kid)["VmRSS"] // MB)
            except FileNotFoundError:  # gone meanwhile
                pass
        await asyncio.sleep(0.25)


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (a router's key processes)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(c) for c in (task / "children").read_text().split()]
    return kids


# -- the run --------------------------------------------------------------------------------------
async def run_mix(s: ServerProcess, soak_s: float, abusive: bool, pids: dict[str, int] | None = None,
                  events: Callable[[ServerProcess, httpx.AsyncClient, Mix], Awaitable[None]] | None = None,
                  attacks: tuple[Callable[[Mix], Awaitable[None]], ...] = ()) -> Mix:
    """For ``soak_s`` seconds (and, with ``abusive``, until ``events`` are through): bursts of 100
    streams, the canary, and with ``abusive`` three abusers, the ``attacks`` (each runs while the
    mix is active: harness/soak_attacks.py) and the scripted ``events``; with ``pids``, their
    processes' VmRSS sampled meanwhile. The mix's requests carry ``s``'s key (``s.headers``)."""
    mix = Mix(soak_s, scripted=abusive and events is not None)
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=s.url, limits=limits, headers=s.headers) as client:
        rng = random.Random(7)
        watched = [asyncio.create_task(canary(client, mix))]
        if pids:
            watched.append(asyncio.create_task(sample_memory(pids, mix)))
        busy = [asyncio.create_task(abuse(client, random.Random(i), mix)) for i in range(3)] if abusive else []
        busy += [asyncio.create_task(attack(mix)) for attack in attacks] if abusive else []
        if abusive and events is not None:
            busy.append(asyncio.create_task(events(s, client, mix)))
        try:
            while mix.active():
                if mix.pause_streams:
                    mix.no_burst.set()
                    await asyncio.sleep(0.1)
                    continue
                mix.no_burst.clear()
                await asyncio.gather(*(stream(client, rng, mix) for _ in range(100)))
            mix.no_burst.set()
            await asyncio.gather(*busy)
        finally:
            mix.abuse_done = True  # the canary and the sampler stop after everyone else
            await asyncio.gather(*watched, return_exceptions=True)
    return mix
