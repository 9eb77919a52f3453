"""The router end to end: three real tiny workers (started once) behind real routers.

Cache-aware vs round-robin on groups sharing long system prompts; session affinity; the
imbalance guard; the exact cache view from the workers' events; bounded queue; the CLI with an
API key and streaming; and last, a worker SIGKILLed under load (no request fails, its circuit
opens, it rejoins after a restart on the same port).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harness.server_utils import ROOT, ServerProcess, free_port
from router.cli import READY_MESSAGE
from router.config import RouterConfig
from router.embedded import RouterThread

pytestmark = pytest.mark.slow
WORDS = "cache page token prefix router worker radix tree load balance session tier host device".split()


def worker_args(model: Path) -> list[str]:
    return ["--model-path", str(model), "--served-model-name", "tiny", "--max-total-tokens", "16384",
            "--enable-cache-events"]


@pytest.fixture(scope="module")
def workers(tiny_chat_model: Path) -> Iterator[list[ServerProcess]]:
    procs = [ServerProcess(worker_args(tiny_chat_model)) for _ in range(3)]  # one thread each (conftest.py)
    threads = [threading.Thread(target=p.start) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        for p in procs:
            assert p.ready.is_set(), p.log()
        yield procs
    finally:
        for p in procs:
            if p.proc is not None and p.proc.poll() is None:
                p.stop()


def router(workers: list[ServerProcess], **kw: object) -> RouterThread:
    base = {"worker_urls": tuple(w.url for w in workers), "health_check_interval_s": 0.5}
    return RouterThread(RouterConfig(**{**base, **kw}))  # type: ignore[arg-type]


def system_prompt(group: str) -> str:
    rng = random.Random(group)
    return f"You are assistant {group}. " + " ".join(rng.choice(WORDS) for _ in range(180))


def chat(client: httpx.Client, url: str, system: str, user: str, **extra: object) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
        **extra,
    }
    r = client.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r


def cached_share(url: str, tag: str) -> tuple[float, Counter[str]]:
    """Groups of 4 questions sharing a long system prompt, one group after the other."""
    cached = prompt = 0
    placed: Counter[str] = Counter()
    with httpx.Client() as c:
        for g in range(6):
            system = system_prompt(f"{tag}-{g}")
            for q in range(4):
                r = chat(c, url, system, f"question {q} of group {g}?")
                usage = r.json()["usage"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                prompt += usage["prompt_tokens"]
                placed[r.headers["x-hicache-worker"]] += 1
    return cached / prompt, placed


def test_cache_aware_beats_round_robin_and_sessions_stick(workers: list[ServerProcess]) -> None:
    with router(workers, policy="round_robin") as rr:
        rr_share, rr_placed = cached_share(rr.url, "rr")
        with httpx.Client() as c:  # affinity on top of round robin
            got = {
                c.post(
                    rr.url + "/generate",
                    json={"text": f"turn {i}", "session_id": "s-rr", "sampling_params": {"max_new_tokens": 1}},
                ).headers["x-hicache-worker"]
                for i in range(4)
            }
            assert len(got) == 1
    with router(workers, policy="cache_aware") as ca:
        ca_share, ca_placed = cached_share(ca.url, "ca")
        with httpx.Client() as c:
            sid = c.post(ca.url + "/open_session", json={}).json()
            owner = {
                c.post(
                    ca.url + "/generate",
                    json={"text": f"turn {i} " * (i + 1), "session_id": sid, "sampling_params": {"max_new_tokens": 1}},
                ).headers["x-hicache-worker"]
                for i in range(4)
            }
            assert len(owner) == 1
            assert c.post(ca.url + "/close_session", json={"session_id": sid}).status_code == 200
    print(f"cached share: cache_aware {ca_share:.2f} {dict(ca_placed)}, round_robin {rr_share:.2f} {dict(rr_placed)}")
    assert len(ca_placed) == 3  # new groups go to the smallest tree: all workers used
    assert ca_share >= 2 * rr_share


def test_imbalance_guard_spreads_a_hot_prefix(workers: list[ServerProcess]) -> None:
    hot = system_prompt("hot")
    with router(workers, balance_abs_threshold=2, balance_rel_threshold=1.5) as r:

        def one(i: int) -> str:
            with httpx.Client() as c:
                extra = {"max_tokens": 16, "ignore_eos": True}
                return chat(c, r.url, hot, f"hot question {i}", **extra).headers["x-hicache-worker"]

        with ThreadPoolExecutor(12) as ex:
            placed = Counter(ex.map(one, range(12)))
        stats = httpx.get(r.url + "/list_workers").json()["policy_stats"]["decisions"]
    print("hot prefix placement:", dict(placed), stats)
    assert len(placed) >= 2 and max(placed.values()) < 12
    assert stats["balance"] > 0 and stats["prefix"] > 0


def test_events_view_finds_the_worker_that_holds_the_prefix(workers: list[ServerProcess]) -> None:
    system = system_prompt("events")
    with httpx.Client() as c:
        chat(c, workers[2].url, system, "warm this worker directly")  # the router never saw it
    with router(workers, cache_view="events", events_poll_interval_s=0.1) as r:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the view has caught up with worker 2
            caches = r.call(lambda: {u: len(c.pages) for u, c in r.state.view.caches.items()})
            if caches.get(workers[2].url):
                break
            time.sleep(0.1)
        with httpx.Client() as c:
            resp = chat(c, r.url, system, "another question")
        assert resp.headers["x-hicache-worker"] == workers[2].url
        usage = resp.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.6 * usage["prompt_tokens"]
        assert httpx.get(r.url + "/list_workers").json()["policy_stats"]["decisions"]["exact"] == 1


def test_bounded_queue_and_worker_admin(workers: list[ServerProcess]) -> None:
    with router(workers, max_concurrent_requests=1, max_queued_requests=1, enable_worker_registration=True) as r:

        def one(i: int) -> int:
            body = {"text": f"slow {i}", "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}
            return httpx.post(r.url + "/generate", json=body, timeout=60).status_code

        with ThreadPoolExecutor(6) as ex:
            codes = Counter(ex.map(one, range(6)))
        assert codes[429] >= 1 and codes[200] >= 2, codes
        with httpx.Client(base_url=r.url) as c:
            assert c.post("/remove_worker", params={"url": workers[0].url}).status_code == 200
            assert [w["url"] for w in c.get("/list_workers").json()["workers"]] == [w.url for w in workers[1:]]
            assert c.post("/add_worker", json={"url": workers[0].url}).json()["worker"]["healthy"] is True
            assert len(c.get("/list_workers").json()["workers"]) == 3
            assert c.post("/add_worker", params={"url": "not a url"}).status_code == 400


def test_cli_router_streams_and_enforces_api_key(workers: list[ServerProcess], tmp_path: Path) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text("policy: power_of_two\nworker_urls:\n" + "".join(f"  - {w.url}\n" for w in workers))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.launch.cli", "router", "--config", str(cfg), "--port", str(port),
         "--api-key", "k"],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == READY_MESSAGE:
                break
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["object"] == "model"
        # the scheme in any case (RFC 7235); a wrong key or another scheme is still a 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "bearer k"}).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer x"}).status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Basic k"}).status_code == 401
        assert httpx.get(url + "/flush_cache", headers=auth).status_code == 405  # state-changing: POST only
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
        body |= {"ignore_eos": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=auth, timeout=60) as s:
            assert s.status_code == 200
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 4  # role, deltas, finish, done
        assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_worker_killed_mid_load_then_rejoins(workers: list[ServerProcess], tiny_chat_model: Path) -> None:
    kw = {"policy": "round_robin", "circuit_failure_threshold": 2, "circuit_cooldown_s": 1.0}
    with router(workers, health_check_interval_s=0.3, **kw) as r:
        victim = workers[2]

        def one(i: int) -> int:
            body = {"text": f"load {i}", "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
            return httpx.post(r.url + "/generate", json=body, timeout=60).status_code

        def victim_state() -> dict:
            return next(w for w in httpx.get(r.url + "/list_workers").json()["workers"] if w["url"] == victim.url)

        with ThreadPoolExecutor(6) as ex:
            futures = [ex.submit(one, i) for i in range(36)]
            deadline = time.monotonic() + 30  # killed while it has requests, with most of the load still to come
            while time.monotonic() < deadline and victim_state()["in_flight"] == 0:
                time.sleep(0.02)
            victim.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            codes = Counter(f.result() for f in futures)
        assert codes == {200: 36}, codes
        deadline = time.monotonic() + 10  # health checks run every 0.3 s
        while time.monotonic() < deadline and (victim_state()["circuit"] == "closed" or victim_state()["healthy"]):
            time.sleep(0.1)
        state = victim_state()
        assert state["circuit"] != "closed" and not state["healthy"], state
        assert state["requests_failed"] >= 2, state
        victim.proc.wait(30)  # type: ignore[union-attr]

        reborn = ServerProcess(worker_args(tiny_chat_model))
        reborn.port, reborn.url = victim.port, victim.url
        reborn.args[reborn.args.index("--port") + 1] = str(victim.port)
        reborn.start()
        workers[2] = reborn  # the fixture stops it
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            state = {w["url"]: w for w in httpx.get(r.url + "/list_workers").json()["workers"]}
            if state[victim.url]["circuit"] == "closed" and state[victim.url]["healthy"]:
                break
            time.sleep(0.2)
        assert state[victim.url]["circuit"] == "closed", state
        before = state[victim.url]["requests_sent"]
        codes = Counter(one(i) for i in range(6))
        assert codes == {200: 6}
        after = {w["url"]: w for w in httpx.get(r.url + "/list_workers").json()["workers"]}
        assert after[victim.url]["requests_sent"] >= before + 2
