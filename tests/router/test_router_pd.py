"""The router's PD mode end to end: a real router (in-process uvicorn, and the CLI) in front of
two fake prefill and two fake decode workers on real HTTP (harness/fake_pd_worker.py).

Checked: both sides get the same body with the same room and the prefill's bootstrap host and
port; the client gets the decode's answer (JSON and SSE); a prefill error wins and closes the
decode's connection; retries use a fresh room; cache-aware prefill choice; load-aware decode
choice; session affinity on both sides; batch rooms; the admin routes; config errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.fake_pd_worker import FakeWorker
from harness.server_utils import ROOT, free_port
from router.cli import READY_MESSAGE
from router.config import ConfigError, RouterConfig, build_config, load_config
from router.embedded import RouterThread

P0_PORT, P1_PORT = 9101, 7777  # p0 announces 9101; p1 announces 9102 but the config says 7777


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, FakeWorker]]:
    ws = {
        "p0": FakeWorker("prefill", "p0", P0_PORT), "p1": FakeWorker("prefill", "p1", 9102),
        "d0": FakeWorker("decode", "d0"), "d1": FakeWorker("decode", "d1"),
    }
    for w in ws.values():
        w.start()
    yield ws
    for w in ws.values():
        w.stop()


@pytest.fixture()
def pd(fleet: dict[str, FakeWorker]) -> Iterator[tuple[RouterThread, dict[str, FakeWorker]]]:
    for w in fleet.values():
        w.reset()
    cfg = RouterConfig(
        pd_disaggregation=True,
        prefill_urls=((fleet["p0"].url, None), (fleet["p1"].url, P1_PORT)),
        decode_urls=(fleet["d0"].url, fleet["d1"].url),
        health_check_interval_s=0.2, load_poll_interval_s=0.05, retry_backoff_s=0.01, cache_threshold=0.5,
        enable_worker_registration=True,  # test_admin_routes_cover_both_sets adds and removes workers
    )
    with RouterThread(cfg) as r:
        yield r, fleet


def by_url(fleet: dict[str, FakeWorker], url: str) -> FakeWorker:
    return next(w for w in fleet.values() if w.url == url)


def paired(fleet: dict[str, FakeWorker], r: httpx.Response) -> tuple[FakeWorker, FakeWorker, dict[str, Any]]:
    """The prefill and decode workers that served ``r``, which both got its body."""
    p = by_url(fleet, r.headers["x-hicache-prefill-worker"])
    d = by_url(fleet, r.headers["x-hicache-worker"])
    assert p.role == "prefill" and d.role == "decode"
    sent = d.generations()[-1]
    deadline = time.monotonic() + 5  # the prefill's copy may still be on its way: the decode answered
    while sent not in p.generations() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent in p.generations()
    return p, d, sent


def check_pair(fleet: dict[str, FakeWorker], r: httpx.Response) -> tuple[FakeWorker, FakeWorker, dict[str, Any]]:
    """The same body to both, with the prefill's bootstrap host and port and a room."""
    p, d, sent = paired(fleet, r)
    assert sent["bootstrap_host"] == "127.0.0.1"
    assert sent["bootstrap_port"] == (P0_PORT if p.name == "p0" else P1_PORT)
    assert isinstance(sent["bootstrap_room"], int) and 0 <= sent["bootstrap_room"] < 2**63
    return p, d, sent


def test_same_body_to_both_and_the_decode_answers(pd: tuple[RouterThread, dict[str, FakeWorker]]) -> None:
    r, fleet = pd
    with httpx.Client(base_url=r.url, timeout=30) as c:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        resp = c.post("/v1/chat/completions", json=chat)
        assert resp.status_code == 200, resp.text
        p, d, sent = check_pair(fleet, resp)
        assert resp.json() == {"text": f"decoded by {d.name}", "room": sent["bootstrap_room"]}
        assert {k: sent[k] for k in chat} == chat
        rooms = {sent["bootstrap_room"]}
        for _ in range(4):  # both prefill workers (two ports), a fresh room each time
            resp = c.post("/v1/completions", json={"prompt": f"{len(rooms)} other " * 20, "max_tokens": 2})
            rooms.add(check_pair(fleet, resp)[2]["bootstrap_room"])
        assert len(rooms) == 5
        assert fleet["p0"].generations() and fleet["p1"].generations()
        body = {"text": "stream me", "stream": True, "sampling_params": {"max_new_tokens": 3}}
        with c.stream("POST", "/generate", json=body) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        p, d, sent = check_pair(fleet, s)
        assert events[-1] == "data: [DONE]"
        assert [json.loads(e[6:]) for e in events[:-1]] == [
            {"token": i, "worker": d.name, "room": sent["bootstrap_room"]} for i in range(3)
        ]


def _eventually(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_error_wins_and_closes_the_decode(
    pd: tuple[RouterThread, dict[str, FakeWorker]], stream: bool
) -> None:
    r, fleet = pd
    for name in ("p0", "p1"):
        fleet[name].behavior = "error:400"
    for name in ("d0", "d1"):
        fleet[name].behavior = "hang"
    resp = httpx.post(r.url + "/generate", json={"text": "bad", "stream": stream}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"].endswith("says 400")
    assert by_url(fleet, resp.headers["x-hicache-worker"]).role == "prefill"  # the prefill's answer
    # the decode the router paired it with is closed: after its body was read (it hangs), or before
    # (the prefill's error came first, on a busy machine)
    decodes = (fleet["d0"], fleet["d1"])
    assert _eventually(lambda: any(w.disconnected.is_set() for w in decodes)), "the decode's connection was not closed"
    assert [w for w in decodes if w.generations() or w.disconnected.is_set()] == \
        [w for w in decodes if w.disconnected.is_set()]  # only the one that was closed was ever reached
    assert sum(w.disconnected.is_set() for w in decodes) == 1
    time.sleep(0.2)
    assert all(w["in_flight"] == 0 for w in httpx.get(r.url + "/list_workers").json()["workers"])


def test_retry_on_a_new_pair_with_a_fresh_room(pd: tuple[RouterThread, dict[str, FakeWorker]]) -> None:
    r, fleet = pd
    for name in ("p0", "p1", "d0", "d1"):  # whichever is chosen first fails once
        fleet[name].behavior = "fail_once:503"
    resp = httpx.post(r.url + "/generate", json={"text": "retry me"}, timeout=30)
    assert resp.status_code == 200, resp.text
    p, d, sent = check_pair(fleet, resp)
    rooms = [b["bootstrap_room"] for w in fleet.values() for b in w.generations()]
    assert len(set(rooms)) >= 2 and rooms.count(sent["bootstrap_room"]) == 2  # one room per attempt
    assert sum(w["requests_failed"] for w in httpx.get(r.url + "/list_workers").json()["workers"]) >= 1


def test_cache_aware_prefill_and_load_aware_decode(pd: tuple[RouterThread, dict[str, FakeWorker]]) -> None:
    r, fleet = pd
    placed: dict[str, set[str]] = {}
    with httpx.Client(base_url=r.url, timeout=30) as c:
        for q in range(3):
            for g in range(4):
                system = f"system prompt of group {g}: " + f"g{g} words " * 40
                resp = c.post("/v1/completions", json={"prompt": system + f"question {q}?", "max_tokens": 1})
                placed.setdefault(f"g{g}", set()).add(resp.headers["x-hicache-prefill-worker"])
        assert all(len(urls) == 1 for urls in placed.values()), placed  # a prefix stays where it is cached
        assert len(set().union(*placed.values())) == 2  # new prefixes go to the emptier tree
        for busy, idle in (("d0", "d1"), ("d1", "d0")):
            fleet[busy].load, fleet[idle].load = 40, 0
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # until the router has polled the new loads
                loads = c.get("/get_load").json()["decode"]
                if loads[fleet[busy].url] == 40 and loads[fleet[idle].url] == 0:
                    break
                time.sleep(0.05)
            got = {c.post("/generate", json={"text": f"x{i}"}).headers["x-hicache-worker"] for i in range(5)}
            assert got == {fleet[idle].url}


def test_sessions_stick_to_one_prefill_and_one_decode(pd: tuple[RouterThread, dict[str, FakeWorker]]) -> None:
    r, fleet = pd
    with httpx.Client(base_url=r.url, timeout=30) as c:
        sid = c.post("/open_session", json={}).json()
        opened = [w for w in fleet.values() if ("/open_session", {"session_id": sid}) in w.received]
        assert sorted(w.role for w in opened) == ["decode", "prefill"]
        d_url = next(w.url for w in opened if w.role == "decode")
        by_url(fleet, d_url).load = 50  # affinity beats load
        time.sleep(0.3)
        pairs = set()
        for i in range(5):
            resp = c.post("/generate", json={"text": f"turn {i} " * (i + 1), "session_id": sid})
            check_pair(fleet, resp)
            pairs.add((resp.headers["x-hicache-prefill-worker"], resp.headers["x-hicache-worker"]))
        assert pairs == {(next(w.url for w in opened if w.role == "prefill"), d_url)}
        assert c.get("/list_workers").json()["sessions"] == 1
        assert c.post("/close_session", json={"session_id": sid}).status_code == 200
        assert all(("/close_session", {"session_id": sid}) in w.received for w in opened)
        assert c.post("/close_session", json={"session_id": sid}).status_code == 404
        assert c.post("/open_session", json={"session_id": "mine"}).json() == "mine"


def test_batch_generate_gets_lists_of_rooms(pd: tuple[RouterThread, dict[str, FakeWorker]]) -> None:
    r, fleet = pd
    for batch in ({"text": ["a", "b", "c"]}, {"input_ids": [[1, 2], [3, 4], [5, 6]]}):
        resp = httpx.post(r.url + "/generate", json=batch, timeout=30)
        assert resp.status_code == 200
        p, _, sent = paired(fleet, resp)
        assert sent["bootstrap_host"] == ["127.0.0.1"] * 3
        assert sent["bootstrap_port"] == [P0_PORT if p.name == "p0" else P1_PORT] * 3
        rooms = sent["bootstrap_room"]
        assert len(set(rooms)) == 3 and all(isinstance(x, int) and 0 <= x < 2**63 for x in rooms)
    resp = httpx.post(r.url + "/generate", json={"input_ids": [1, 2, 3]}, timeout=30)  # one prompt
    assert isinstance(by_url(fleet, resp.headers["x-hicache-worker"]).generations()[-1]["bootstrap_room"], int)


def test_admin_routes_cover_both_sets(pd: tuple[RouterThread, dict[str, FakeWorker]]) -> None:
    r, fleet = pd
    with httpx.Client(base_url=r.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        listed = {w["url"]: w for w in c.get("/list_workers").json()["workers"]}
        assert {u: w["role"] for u, w in listed.items()} == {w.url: w.role for w in fleet.values()}
        assert listed[fleet["p0"].url]["bootstrap_port"] == P0_PORT  # from its /server_info
        assert listed[fleet["p1"].url]["bootstrap_port"] == P1_PORT  # configured
        load = c.get("/get_load").json()
        assert set(load["prefill"]) == {fleet["p0"].url, fleet["p1"].url} and len(load["workers"]) == 4
        assert c.post("/flush_cache").json()["success"] is True
        assert all(("/flush_cache", {}) in w.received for w in fleet.values())
        assert c.post("/remove_worker", params={"url": fleet["d1"].url}).status_code == 200
        assert c.post("/remove_worker", params={"url": fleet["d0"].url}).status_code == 200
        assert c.get("/health").status_code == 503  # no decode worker
        assert c.post("/generate", json={"text": "x"}).json()["error"]["message"] == "no decode worker is available"
        added = c.post("/add_worker", json={"url": fleet["d1"].url}).json()["worker"]  # role from /server_info
        assert added["role"] == "decode" and c.get("/health").status_code == 200
        assert c.post("/add_worker", params={"url": fleet["d0"].url, "role": "prefill"}).json()["worker"]["role"] == (
            "prefill"
        )
        assert c.post("/add_worker", params={"url": fleet["d0"].url, "role": "decode"}).status_code == 400


def test_config_errors_and_yaml() -> None:
    cfg = load_config(ROOT / "configs/router-pd.yaml")
    assert cfg.pd_disaggregation and cfg.prefill_urls[1] == ("http://127.0.0.1:30001", 8999)
    for bad in (
        {"prefill_urls": ["http://a:1"]},
        {"pd_disaggregation": True, "prefill_urls": ["http://a:1"]},
        {"pd_disaggregation": True, "prefill_urls": ["http://a:1"], "decode_urls": ["http://b:1"],
         "worker_urls": ["http://c:1"]},
        {"pd_disaggregation": True, "prefill_urls": [["http://a:1", 1, 2]], "decode_urls": ["http://b:1"]},
    ):
        with pytest.raises(ConfigError):
            build_config(bad)
    cli = [sys.executable, "-m", "router.cli"]
    for args, message in (
        (["--prefill", "http://a:1"], "need pd_disaggregation (--pd-disaggregation)"),
        (["--pd-disaggregation", "--prefill", "http://a:1"], "one decode worker (--decode URL)"),
        (["--pd-disaggregation", "--prefill", "http://a:1", "x", "--decode", "http://b:1"], "must be a number"),
    ):
        out = subprocess.run(cli + args, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, out.stderr


def test_cli_pd_router(fleet: dict[str, FakeWorker]) -> None:
    for w in fleet.values():
        w.reset()
    port = free_port()
    args = ["--pd-disaggregation", "--port", str(port), "--prefill", fleet["p1"].url, "none",
            "--decode", fleet["d0"].url, "--decode", fleet["d1"].url]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "router.cli", *args], cwd=ROOT, text=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == READY_MESSAGE:
                break
        resp = httpx.post(f"http://127.0.0.1:{port}/generate", json={"text": "via the CLI"}, timeout=30)
        assert resp.status_code == 200 and resp.json()["text"].startswith("decoded by d")
        # the decode answered first: the router reads the prefill's answer in the background
        assert _eventually(lambda: fleet["p1"].generations())
        assert fleet["p1"].generations()[-1]["bootstrap_port"] == 9102  # "none": its /server_info's
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_pd_tenants_scope_sessions_pass_keys_on_and_take_back_refused_attempts(
        fleet: dict[str, FakeWorker], tmp_path) -> None:
    """With an api-keys file: a tenant's key reaches both workers as it came; sessions are the
    tenant's (another tenant cannot close them); a request the prefill side refused leaves
    nothing in the routing tree."""
    for w in fleet.values():
        w.reset()
    (tmp_path / "keys.yaml").write_text("keys:\n  sk-alice-0001: alice\n  sk-bob-00001: bob\n")
    cfg = RouterConfig(
        pd_disaggregation=True, prefill_urls=((fleet["p0"].url, None), (fleet["p1"].url, P1_PORT)),
        decode_urls=(fleet["d0"].url, fleet["d1"].url), api_key="admin-key-0001",
        api_keys_file=str(tmp_path / "keys.yaml"), health_check_interval_s=0.2, retry_backoff_s=0.01)
    alice, bob = {"Authorization": "Bearer sk-alice-0001"}, {"Authorization": "Bearer sk-bob-00001"}
    with RouterThread(cfg) as r, httpx.Client(base_url=r.url, timeout=30) as c:
        assert c.post("/open_session", json={"session_id": "s1"}, headers=alice).json() == "s1"
        resp = c.post("/generate", json={"text": "hello " * 8, "session_id": "s1"}, headers=alice)
        p, d, _ = check_pair(fleet, resp)
        assert p.auth[-1] == d.auth[-1] == "Bearer sk-alice-0001"
        assert c.post("/close_session", json={"session_id": "s1"}, headers=bob).status_code == 404
        assert c.post("/close_session", json={"session_id": "s1"}, headers=alice).status_code == 200
        admin = {"Authorization": "Bearer admin-key-0001"}
        before = c.get("/list_workers", headers=admin).json()["policy_stats"]
        for name in ("p0", "p1"):
            fleet[name].behavior = "error:400"
        for name in ("d0", "d1"):
            fleet[name].behavior = "hang"  # the prefill's answer comes first
        assert c.post("/generate", json={"text": "refused " * 20}, headers=alice).status_code == 400
        after = c.get("/list_workers", headers=admin).json()["policy_stats"]
        held = lambda st: {url: n for url, n in st["tree_sizes"].items() if n}  # noqa: E731
        assert held(after) == held(before) and after["retracted"] > before["retracted"], after
