"""Soak: a canary keeps getting answers while an abusive mix runs against the real server.

For at least ``SOAK_S`` seconds (30 by default; ``HICACHE_SOAK_S`` changes it) and until the
scripted events below are through (~60 s in all here), a canary sends one short greedy
/generate every half second, while workers keep sending: pathological regexes and JSON
schemas, the self-recursive JSON schema and EBNF grammar of issue 25 (/generate's
``json_schema`` and ``ebnf``, OpenAI's ``response_format``: each a 200, the jump-forward
bounded), prompts far over the context, 10,000-deep JSON, broken bodies and wrong content
types, a model the server does not serve, bursts of 100 parallel streams of which about half
disconnect after a few tokens, and requests aborted right after they start. One after the
other, the scripted events: 8 concurrent 7.8 MB prompts (400s naming the context), a SIGSTOP of
the engine process past ``--watchdog-timeout`` (5 s here) then SIGCONT, 300 pins of the same
7-page prefix (each a 200 for the 112 tokens; all released), and 20,000 session opens (exactly
``--max-sessions`` 4096 get a 200, every other one a 429 naming the cap; a session of the full
table still serves; all closed, then a fresh session serves). The 20,000 opens go through aiohttp
with 128 connections: here httpx's AsyncClient costs ~3.8 ms of client CPU per request (and the
server ~2.2 ms, against ~1.1 ms for aiohttp's requests), which would triple this test's time.

The stall window runs from the SIGSTOP until ``/health`` is 200 again after the SIGCONT. The
only 5xx allowed: a 503 whose message is the watchdog's ("the engine has made no progress"),
for a request sent before the window ended and answered after it began: ``/health`` itself,
and whatever the HTTP side refused or stopped waiting for while it saw the stall (requests
already waiting keep waiting: their 200 comes after the SIGCONT). Everything else is asserted
as before: no other 5xx, every bad request its 4xx.

The bound: the canary's p99 latency under the abuse stays under 3x its median latency under
the same 100 streams without the abuse (measured first, for 15 s) plus 3 s, counting only the
canary requests outside the stall window (one in flight during it necessarily waits for the
engine). On this 2-core machine the canary answers in ~0.05 s alone and in ~0.6-1 s while 100
streams share the batch; under the abuse its p99 was 2.7-3.0 s: each pathological regex kills
its compile worker at the 10 s budget, and the restart (importing xgrammar and torch, ~2.5 s of
CPU) competes with serving for the 2 cores -- that is the 3 s. No abusive request may make the
canary wait for it (compiles run in worker processes, bounded in time; the rest is refused
before it reaches the engine). The canary runs until the abusers are done: it keeps the engine
making progress, so a request left waiting for a compile is never alone (the watchdog counts
"no progress with work pending", and a lone compile makes none).

Memory: VmRSS of the HTTP process and of the engine process is sampled every 0.25 s from /proc
and their VmHWM (reset when the mix starts) read at its end: each peak stays within
``HTTP_PEAK_MB`` / ``ENGINE_PEAK_MB`` of its VmRSS when the mix started, and each VmRSS after
the mix within ``HTTP_AFTER_MB`` / ``ENGINE_AFTER_MB`` (measured here: see the constants).
After the mix ``check_integrity()`` holds with nothing running and no page or lock left over,
and a SIGTERM shuts the server down cleanly with its L3 persisted (the engine's report says how
many pages, and that none were left unwritten).

Issue 42's attacks run beside the mix (harness/soak_attacks.py): the server has an admin key and two
tenants (alice, bob), a router in front of it has the same keys and read timeouts. Bob's key on every
admin route of both is a 403; 20 MB bodies to the router are 413s while requests routed after them
are 200s; alice's and bob's 1 h cache_control floods are 200s whose usage says what each pinned (the
server-wide pin budget keeps half of L2 free, so the shutdown still persists every page); waves of
slowloris connections to both are closed with a 408 at the 3 s timeout; short requests sent while a
~7.8k-token prompt is prefilled stay within the canary's bound. The router's VmRSS stays under
``ROUTER_PEAK_MB`` and each of its key processes' under ``KEY_PROCESS_PEAK_MB`` (measured here: 120 and
95 MB). The router's 503 "no worker is available" counts as allowed only around the stall (its health
check and circuit cooldown take the worker back a moment after the worker's /health is 200).

The traffic (the canary, the streams, the abusers, the memory sampler) is harness/soak_mix.py, the
attacks harness/soak_attacks.py; the scripted events and the verdict are here.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml

from harness import soak_attacks
from harness.server_utils import RouterProcess, ServerProcess, proc_status, running_server
from harness.soak_attacks import ADMIN, KEYS, Target
from harness.soak_mix import CANARY, CANARY_EVERY_S, MB, ROUTER_HEALTH_S, Mix, run_mix

pytestmark = pytest.mark.slow
SOAK_S = float(os.environ.get("HICACHE_SOAK_S", "30"))
BASELINE_S = 15.0
WATCHDOG_S = 10.0
MAX_SESSIONS, OPENS, BULK_CONNECTIONS = 4096, 20_000, 128
PINS, PREFIX = 300, [(7 * i) % 400 + 30 for i in range(120)]  # 7 full pages of 16
HUGE = "word " * 1_560_000  # 7.8 MB, 1.56 M tokens
# growth over the mix's start, in MB; measured here (2 cores, tiny model): HTTP peak +117, after +1;
# engine peak +52, after +35 (before issue 25's fixes the 8 huge prompts alone took the HTTP process to 9.1 GB)
HTTP_PEAK_MB, HTTP_AFTER_MB = 512, 256
ENGINE_PEAK_MB, ENGINE_AFTER_MB = 512, 256


CONTEXT = 8192  # room for soak_attacks' ~7.8k-token prompt
SLOW_S = 3.0  # the worker's and the router's read timeouts (header, body idle) for the slowloris attack
# the router and each of its key processes (VmRSS, MB) while 20 MB bodies and routed requests go through
ROUTER_PEAK_MB, KEY_PROCESS_PEAK_MB = 400, 300


def config(tmp_path: Path, model: Path) -> Path:
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump(KEYS))
    cfg = {
        "model": {"model_path": str(model), "served_model_name": "m", "context_length": CONTEXT},
        "cache": {"page_size": 16, "hicache_ratio": 2.0, "hicache_mem_layout": "page_first",
                  "hicache_storage_backend": "lmdb",
                  "hicache_storage_backend_extra_config": {"path": str(tmp_path / "l3"), "capacity_gb": 0.5},
                  "hicache_storage_prefetch_policy": "timeout"},
        "scheduler": {"max_running_requests": 256},  # the canary shares the batch, never waits for a slot
        # sessions are closed by the test (an idle timeout during the flood would change its count)
        "server": {"session_idle_timeout_s": 600, "watchdog_timeout": WATCHDOG_S, "api_keys_file": str(keys),
                   "header_timeout_s": SLOW_S, "body_idle_timeout_s": SLOW_S},
    }
    out = tmp_path / "soak.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


# -- the scripted events ------------------------------------------------------------------------
async def huge_prompts(client: httpx.AsyncClient, mix: Mix) -> None:
    bodies = [("/generate", {"text": HUGE, "sampling_params": {"max_new_tokens": 2}}),
              ("/v1/completions", {"model": "m", "prompt": HUGE, "max_tokens": 2}),
              ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": HUGE}]}),
              ("/api/generate", {"model": "m", "prompt": HUGE, "raw": True, "stream": False})] * 2
    raws = [(path, json.dumps(body).encode()) for path, body in bodies]
    t0 = time.monotonic()
    answers = await asyncio.gather(*(client.post(path, content=raw, timeout=300, headers={
        "Content-Type": "application/json"}) for path, raw in raws))
    for r in answers:
        await mix.add_response("huge8", r, t0)
        assert r.status_code == 400 and f"context length is {CONTEXT}" in r.text, r.text[:300]


async def stop_the_engine(s: ServerProcess, client: httpx.AsyncClient, mix: Mix) -> None:
    pid = int((await client.get("/get_server_info", timeout=60)).json()["engine"]["pid"])
    seen = set(s.lines)

    def logged(text: str) -> bool:
        return any(text in line and line not in seen for line in list(s.lines))

    async def health_until(status: int) -> None:
        deadline = time.monotonic() + WATCHDOG_S + 60  # generous: the machine may be loaded
        while True:
            t0 = time.monotonic()
            r = await client.get("/health", timeout=60)
            await mix.add_response("health", r, t0)
            if r.status_code == status:
                return
            assert time.monotonic() < deadline, f"/health stayed {r.status_code}, wanted {status}"
            await asyncio.sleep(0.05)

    stopped = time.monotonic()
    mix.window = (stopped, float("inf"))
    os.kill(pid, signal.SIGSTOP)
    try:
        await health_until(503)
        mix.notes["health_503_after_s"] = round(time.monotonic() - stopped, 2)
        while not logged("engine watchdog: the engine has made no progress"):  # the watch task logs the trip
            assert time.monotonic() - stopped < WATCHDOG_S + 60, s.log()[-3000:]
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # stopped on, past the trip
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    await health_until(200)
    mix.window = (stopped, time.monotonic())
    mix.notes["stopped_s"], mix.notes["health_200_after_s"] = round(resumed - stopped, 2), round(
        mix.window[1] - resumed, 2)
    while not logged("engine watchdog: the engine makes progress again"):
        assert time.monotonic() - mix.window[1] < 30, s.log()[-3000:]
        await asyncio.sleep(0.05)
    mix.notes["logged_after_s"] = round(time.monotonic() - resumed, 2)


async def bulk_post(c: aiohttp.ClientSession, path: str, bodies: list[dict[str, Any]],
                    method: str = "POST") -> list[tuple[int, Any]]:
    """``bodies`` sent over ``c``'s connections, one request in flight per connection; (status,
    JSON body) in order."""
    out: list[tuple[int, Any]] = [(0, None)] * len(bodies)
    todo = iter(range(len(bodies)))

    async def sender() -> None:
        for i in todo:
            url = path.format(**bodies[i]) if method == "DELETE" else path
            async with c.request(method, url, json=None if method == "DELETE" else bodies[i]) as r:
                text = await r.text()
                try:
                    out[i] = (r.status, json.loads(text))
                except ValueError:
                    out[i] = (r.status, text)

    await asyncio.gather(*(sender() for _ in range(BULK_CONNECTIONS)))
    return out


async def pins(c: aiohttp.ClientSession, mix: Mix) -> None:
    pin = {"input_ids": PREFIX, "ttl_s": 600}
    for _ in range(5):  # the prefix, fresh in the cache (pinned, it stays on L2)
        t0 = time.monotonic()
        (gen, body), = await bulk_post(c, "/generate", [{"input_ids": PREFIX,
                                                         "sampling_params": {"max_new_tokens": 1}}])
        mix.add("pin", gen, t0, json.dumps(body)[:300])
        (status, first), = await bulk_post(c, "/cache/pin", [pin])
        mix.add("pin", status, t0, json.dumps(first)[:300])
        if status == 200 and first["pinned_tokens"] == len(PREFIX) // 16 * 16:
            break
        if status == 200:  # partly evicted between the two calls: again
            await bulk_post(c, "/cache/pin/{lease_id}", [first], method="DELETE")
    assert status == 200 and first["pinned_tokens"] == 112, first
    t0 = time.monotonic()
    rest = await bulk_post(c, "/cache/pin", [pin] * (PINS - 1))
    for status, body in rest:
        mix.add("pin", status, t0, json.dumps(body)[:300])
        assert status == 200 and body["pinned_tokens"] == 112, body  # its pages counted once: all fit
    t0 = time.monotonic()
    for status, body in await bulk_post(c, "/cache/pin/{lease_id}", [first] + [b for _, b in rest], method="DELETE"):
        mix.add("pin", status, t0, json.dumps(body)[:300])
        assert status == 200, body
    mix.notes["pins_s"] = round(time.monotonic() - t0, 1)


async def session_flood(c: aiohttp.ClientSession, mix: Mix) -> None:
    t0 = time.monotonic()
    answers = await bulk_post(c, "/open_session", [{}] * OPENS)
    mix.notes["flood_open_s"] = round(time.monotonic() - t0, 1)
    for status, body in answers:
        mix.add("flood", status, t0, json.dumps(body)[:300] if status >= 500 else "")
    opened = [body for status, body in answers if status == 200]
    codes = Counter(status for status, _ in answers)
    assert codes == {200: MAX_SESSIONS, 429: OPENS - MAX_SESSIONS}, codes  # the cap, exactly
    refusals = {re.sub(r"^\d+ sessions", "N sessions", body["error"]["message"]) for status, body in answers
                if status == 429}
    assert len(refusals) == 1 and f"(max_sessions {MAX_SESSIONS})" in refusals.pop(), refusals
    t1 = time.monotonic()  # a session of the full table serves; one more open is still refused
    (status, body), = await bulk_post(c, "/generate", [{**CANARY, "session_id": opened[0]}])
    (full, _), = await bulk_post(c, "/open_session", [{}])
    mix.add("session", status, t1, json.dumps(body)[:300])
    assert status == 200 and full == 429, (status, body, full)
    for status, body in await bulk_post(c, "/close_session", [{"session_id": sid} for sid in opened]):
        mix.add("flood", status, t0, json.dumps(body)[:300] if status >= 500 else "")
        assert status == 200, body
    mix.notes["flood_s"] = round(time.monotonic() - t0, 1)
    t1 = time.monotonic()  # room again: a fresh session serves
    (status, sid), = await bulk_post(c, "/open_session", [{}])
    mix.add("session", status, t1, json.dumps(sid)[:300])
    for path, body in (("/generate", {**CANARY, "session_id": sid}), ("/close_session", {"session_id": sid})):
        (status, answer), = await bulk_post(c, path, [body])
        mix.add("session", status, t1, json.dumps(answer)[:300])
        assert status == 200, answer


async def events(s: ServerProcess, client: httpx.AsyncClient, mix: Mix) -> None:
    """The scripted events, one after the other (the bulk ones over aiohttp: see the docstring)."""
    try:
        await asyncio.sleep(2.0)  # the mix is under way
        await huge_prompts(client, mix)
        await stop_the_engine(s, client, mix)
        async with aiohttp.ClientSession(s.url, connector=aiohttp.TCPConnector(limit=BULK_CONNECTIONS),
                                         headers=s.headers) as c:
            await pins(c, mix)
            mix.pause_streams = True  # see the module docstring
            await mix.no_burst.wait()
            try:
                await session_flood(c, mix)
            finally:
                mix.pause_streams = False
    finally:
        mix.events_done = True


async def start_compile_workers(url: str, headers: dict[str, str]) -> None:
    """The first grammar starts the compile workers (seconds of CPU). Plain requests run
    meanwhile: a request waiting for its compile makes no progress, and alone it would trip
    the short watchdog (a 503: the watchdog counts "no progress with work pending")."""
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as client:
        first = asyncio.create_task(client.post("/generate", json={"text": "Hi", "sampling_params": {
            "max_new_tokens": 2, "regex": "[ab]+"}}))
        while not first.done():
            assert (await client.post("/generate", json=CANARY)).status_code == 200
        r = await first
        assert r.status_code == 200, r.text


def start_router(tmp_path: Path, worker: ServerProcess) -> RouterProcess:
    """The router in front of the worker, with the same keys and the same read timeouts."""
    router = RouterProcess(["--worker-urls", worker.url, "--api-keys-file", str(tmp_path / "keys.yaml"),
                            "--health-check-interval-s", str(ROUTER_HEALTH_S), "--circuit-cooldown-s",
                            str(ROUTER_HEALTH_S), "--header-timeout-s", str(SLOW_S),
                            "--body-idle-timeout-s", str(SLOW_S)], api_key=ADMIN)
    router.start()
    return router


def test_canary_survives_the_abusive_mix(tmp_path):
    from harness.model_utils import tiny_model

    model = tiny_model(tmp_path / "model", with_tokenizer=True, max_position_embeddings=CONTEXT)
    with running_server(["--config", str(config(tmp_path, model))], api_key=ADMIN) as s:
        router = start_router(tmp_path, s)
        asyncio.run(start_compile_workers(s.url, s.headers))
        base = asyncio.run(run_mix(s, BASELINE_S, abusive=False))  # the canary under the 100 streams alone
        base_lat = [t1 - t0 for t0, t1 in base.canary]
        assert s.proc is not None and router.proc is not None
        pids = {"http": s.proc.pid, "router": router.proc.pid,
                "engine": int(httpx.get(s.url + "/get_server_info", headers=s.headers).json()["engine"]["pid"])}
        start = {name: proc_status(pid)["VmRSS"] for name, pid in pids.items()}
        for pid in (s.proc.pid, pids["engine"]):
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS: the peak from here on
        t_mix = time.monotonic()
        target = Target(s.url, router.url)
        attacks = tuple(functools.partial(attack, target) for attack in soak_attacks.ATTACKS)
        try:
            mix = asyncio.run(run_mix(s, SOAK_S, abusive=True, pids=pids, events=events, attacks=attacks))
        finally:
            assert router.stop() == 0, router.log()[-3000:]
        mix_s = time.monotonic() - t_mix
        end = {name: proc_status(pids[name]) for name in ("http", "engine")}
        assert mix.window is not None
        lat = [t1 - t0 for t0, t1 in mix.canary if not (t0 < mix.window[1] and t1 >= mix.window[0])]
        p99 = sorted(lat)[min(len(lat) - 1, int(0.99 * len(lat)))]
        bound = 3 * statistics.median(base_lat) + 3.0
        summary = {k: sorted(mix.codes(k)) for k in mix.answers}
        allowed = {k: sum(mix.allowed_503(*a) for a in v) for k, v in mix.answers.items()}
        memory = {name: {"start": start[name] // MB, "peak": end[name]["VmHWM"] // MB,
                         "after": end[name]["VmRSS"] // MB} for name in ("http", "engine")}
        memory |= {name: {"start": start[name] // MB if name in start else None, "peak": peak} for name, peak in
                   mix.notes["sampled_rss_mb"].items() if name not in memory}  # the router's, sampled
        print("canary latencies (s):", [round(x, 2) for x in lat])
        print(f"mix {mix_s:.0f} s; canary: {len(lat)} answers outside the stall window "
              f"({len(mix.canary) - len(lat)} in it), median under the streams alone "
              f"{statistics.median(base_lat):.3f} s, "
              f"p99 under the abuse {p99:.3f} s (bound {bound:.2f} s); status codes by kind: {summary}; "
              f"allowed 503s by kind: {allowed}; window {mix.window[1] - mix.window[0]:.1f} s; {mix.notes}; "
              f"memory (MB): {memory}")
        assert len(lat) >= SOAK_S / CANARY_EVERY_S / 4, "the canary was starved"
        assert p99 <= bound, (p99, bound)
        assert all(c < 500 for k in mix.answers for c in mix.codes(k)), (summary, [
            a for v in mix.answers.values() for a in v if a[0] >= 500 and not mix.allowed_503(*a)][:5])
        assert allowed.get("health", 0) >= 1, allowed  # /health said 503 during the stall
        assert mix.codes("canary") == {200} and mix.codes("stream") == {200}, summary
        assert mix.codes("recursive") == {200} and mix.codes("session") == {200}, summary
        for kind in ("regex", "huge", "deep", "broken", "types"):
            assert all(400 <= c < 500 for c in mix.codes(kind)), (kind, summary)
        assert mix.codes("plain") == {415} and mix.codes("model") == {404} and mix.codes("huge8") == {400}, summary
        assert mix.codes("pin") == {200} and mix.codes("flood") == {200, 429}, summary  # counts: session_flood
        for name, peak, after in (("http", HTTP_PEAK_MB, HTTP_AFTER_MB), ("engine", ENGINE_PEAK_MB, ENGINE_AFTER_MB)):
            assert memory[name]["peak"] - memory[name]["start"] <= peak, (name, memory)
            assert memory[name]["after"] - memory[name]["start"] <= after, (name, memory)
        # issue 42's attacks: tenants never act as admins, 20 MB bodies are refused at the router while
        # routed requests flow, breakpoint floods are served and say what they pinned, slowloris
        # connections are closed, short requests beside a ~7.8k-token prompt keep the canary's bound
        assert mix.codes("tenant_admin") == {403}, summary
        assert mix.codes("router_huge") == {413} and mix.codes("routed") == {200}, summary
        assert mix.codes("breakpoint") == {200}, summary  # 299: a silent 0 (soak_attacks.breakpoints)
        assert mix.codes("slowloris") == {408}, summary
        assert max(mix.notes["slowloris_closed_s"]) <= SLOW_S + 10, mix.notes["slowloris_closed_s"]
        assert mix.codes("long") == {200} and mix.codes("beside_long") == {200}, summary
        beside = [t1 - t0 for c, t0, t1, _ in mix.answers["beside_long"]
                  if not (t0 < mix.window[1] and t1 >= mix.window[0])]
        assert max(beside) <= bound, (max(beside), bound)
        assert memory["router"]["peak"] <= ROUTER_PEAK_MB, memory
        assert memory["key_process"]["peak"] <= KEY_PROCESS_PEAK_MB, memory
        body = s.check_integrity(settle_s=60)
        assert body["ok"], body
        assert body["running"] == 0 and body["waiting"] == 0 and body["sessions"] == 0, body
    persisted = re.search(r"persisted (\d+) pages to L3, (\d+) not written", s.log())
    assert persisted and int(persisted.group(1)) > 0 and persisted.group(2) == "0", s.log()[-3000:]
