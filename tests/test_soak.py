"""Soak: a canary keeps getting answers while an abusive mix runs against the real server.

For ``SOAK_S`` seconds (45 by default; ``HICACHE_SOAK_S`` changes it) a canary sends one short
greedy /generate every half second, while workers keep sending: pathological regexes and JSON
schemas, prompts far over the context, 10,000-deep JSON, broken bodies and wrong content
types, a model the server does not serve, bursts of 100 parallel streams of which about half
disconnect after a few tokens, session floods, and requests aborted right after they start.

The bound: the canary's p99 latency under the abuse stays under 3x its median latency under
the same 100 streams without the abuse (measured first, for 15 s) plus 3 s. On this 2-core
machine the canary answers in ~0.05 s alone and in ~0.6-1 s while 100 streams share the
batch; under the abuse its p99 was 2.7-3.0 s: each pathological regex kills its compile
worker at the 10 s budget, and the restart (importing xgrammar and torch, ~2.5 s of CPU)
competes with serving for the 2 cores -- that is the 3 s. No abusive request may make the
canary wait for it (compiles run in worker processes, bounded in time; the rest is refused
before it reaches the engine).
No response is a 5xx, every bad request gets its 4xx, ``check_integrity()`` holds after the mix
with no page or lock left over, and a SIGTERM shuts the server down cleanly with its L3
persisted (the engine's report says how many pages, and that none were left unwritten).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import statistics
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.server_utils import running_server

pytestmark = pytest.mark.slow
SOAK_S = float(os.environ.get("HICACHE_SOAK_S", "45"))
BASELINE_S = 15.0
CANARY_EVERY_S = 0.5
CANARY = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


def config(tmp_path: Path, model: Path) -> Path:
    cfg = {
        "model": {"model_path": str(model), "served_model_name": "m"},
        "cache": {"page_size": 16, "hicache_ratio": 2.0, "hicache_mem_layout": "page_first",
                  "hicache_storage_backend": "lmdb",
                  "hicache_storage_backend_extra_config": {"path": str(tmp_path / "l3"), "capacity_gb": 0.5},
                  "hicache_storage_prefetch_policy": "timeout"},
        "scheduler": {"max_running_requests": 256},  # the canary shares the batch, never waits for a slot
        "server": {"session_idle_timeout_s": 30},
    }
    out = tmp_path / "soak.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


class Tally:
    def __init__(self) -> None:
        self.codes: dict[str, list[int]] = {}

    def add(self, kind: str, code: int) -> None:
        self.codes.setdefault(kind, []).append(code)


async def canary(client: httpx.AsyncClient, until: float, lat: list[float], tally: Tally) -> None:
    while time.monotonic() < until:
        t0 = time.monotonic()
        r = await client.post("/generate", json=CANARY, timeout=120)
        lat.append(time.monotonic() - t0)
        tally.add("canary", r.status_code)
        await asyncio.sleep(max(0.0, CANARY_EVERY_S - (time.monotonic() - t0)))


async def stream(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    drop = rng.random() < 0.5
    body = {"text": f"story {rng.random()}", "stream": True,
            "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0.7}}
    async with client.stream("POST", "/generate", json=body, timeout=120) as r:
        tally.add("stream", r.status_code)
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: ")
            if drop and n >= 3:
                return  # the client goes away mid-stream: the server aborts the request


async def abuse(client: httpx.AsyncClient, rng: random.Random, until: float, tally: Tally) -> None:
    deep = "[" * 10_000 + "]" * 10_000
    bad = [
        ("regex", dict(json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "regex": "(a|b)*" * 2000}})),
        ("schema", dict(json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "json_schema": json.dumps(
            {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "(a|b)*" * 50}
                                              for i in range(200)}})}})),
        ("huge", dict(json={"text": "word " * 60_000, "sampling_params": {"max_new_tokens": 2}})),
        ("deep", dict(content=f'{{"text": "x", "sampling_params": {deep}}}',
                      headers={"Content-Type": "application/json"})),
        ("broken", dict(content=b'{"text": "x", ', headers={"Content-Type": "application/json"})),
        ("types", dict(json={"text": 5, "sampling_params": {"max_new_tokens": "many"}})),
        ("plain", dict(content=b'{"text": "x"}', headers={"Content-Type": "text/plain"})),
    ]
    while time.monotonic() < until:
        kind, kw = rng.choice(bad)
        r = await client.post("/generate", timeout=120, **kw)
        tally.add(kind, r.status_code)
        r = await client.post("/v1/chat/completions", timeout=120, json={
            "model": "gpt-4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        tally.add("model", r.status_code)
        if rng.random() < 0.3:  # a session flood: open many, use one, close half
            sids = []
            for _ in range(20):
                r = await client.post("/open_session", json={}, timeout=60)
                tally.add("session", r.status_code)
                if r.status_code == 200:
                    sids.append(r.json())
            if sids:
                r = await client.post("/generate", timeout=120, json={**CANARY, "session_id": sids[0]})
                tally.add("session", r.status_code)
            for sid in sids[: len(sids) // 2]:
                r = await client.post("/close_session", json={"session_id": sid}, timeout=60)
                tally.add("session", r.status_code)
        if rng.random() < 0.3:  # started, then aborted right away (the client gives up)
            try:
                await client.post("/generate", timeout=0.05, json={
                    "text": f"abort me {rng.random()}", "sampling_params": {"max_new_tokens": 200}})
            except httpx.TimeoutException:
                pass


async def run_mix(url: str, until: float, lat: list[float], tally: Tally, abusive: bool = True) -> None:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        rng = random.Random(7)
        tasks = [asyncio.create_task(canary(client, until, lat, tally))]
        if abusive:
            tasks += [asyncio.create_task(abuse(client, random.Random(i), until, tally)) for i in range(3)]
        while time.monotonic() < until - 5:
            await asyncio.gather(*(stream(client, rng, tally) for _ in range(100)))
        await asyncio.gather(*tasks)


def test_canary_survives_the_abusive_mix(tmp_path, tiny_chat_model):
    with running_server(["--config", str(config(tmp_path, tiny_chat_model))]) as s:
        r = httpx.post(s.url + "/generate", timeout=120, json={"text": "Hi", "sampling_params": {
            "max_new_tokens": 2, "regex": "[ab]+"}})  # starts the grammar compile workers
        assert r.status_code == 200, r.text
        base: list[float] = []  # the canary under the same 100 streams, without the abuse
        asyncio.run(run_mix(s.url, time.monotonic() + BASELINE_S, base, Tally(), abusive=False))
        lat: list[float] = []
        tally = Tally()
        asyncio.run(run_mix(s.url, time.monotonic() + SOAK_S, lat, tally))
        p99 = sorted(lat)[min(len(lat) - 1, int(0.99 * len(lat)))]
        bound = 3 * statistics.median(base) + 3.0
        summary = {k: sorted(set(v)) for k, v in tally.codes.items()}
        print("canary latencies (s):", [round(x, 2) for x in lat])
        print(f"canary: {len(lat)} answers, median under the streams alone {statistics.median(base):.3f} s, "
              f"p99 under the abuse {p99:.3f} s (bound {bound:.2f} s); status codes by kind: {summary}")
        assert len(lat) >= SOAK_S / CANARY_EVERY_S / 4, "the canary was starved"
        assert p99 <= bound, (p99, bound)
        assert all(c < 500 for v in tally.codes.values() for c in v), summary
        assert set(tally.codes["canary"]) == {200} and set(tally.codes["stream"]) == {200}, summary
        for kind in ("regex", "huge", "deep", "broken", "types"):
            assert all(400 <= c < 500 for c in tally.codes.get(kind, [400])), (kind, summary)
        assert set(tally.codes.get("plain", [415])) == {415} and set(tally.codes["model"]) == {404}, summary
        body = s.check_integrity(settle_s=60)
        assert body["ok"], body
        assert body["running"] == 0 and body["waiting"] == 0, body
    persisted = re.search(r"persisted (\d+) pages to L3, (\d+) not written", s.log())
    assert persisted and int(persisted.group(1)) > 0 and persisted.group(2) == "0", s.log()[-3000:]
