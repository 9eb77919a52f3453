"""Warm drains (serving/server/drain_api.py, router/worker_drain.py): two real workers behind a real router with a
real Mooncake Store as their shared L3 (in a network namespace of their own); sessions and a pin lease
on worker A; A drained through the router; the sessions' next turns go to B and are served from L3
(storage hits = the previous context), with the same greedy fp32 answers as a cold computation;
nothing is lost or leaked on A. The single-worker part (503 while draining, the report, SIGTERM with
--drain-on-shutdown) runs without Mooncake, on LMDB."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from harness.netns import run_mooncake_script
from harness.server_utils import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_drain_rehomes_sessions_onto_the_shared_l3(tmp_path, tiny_chat_model):
    res = run_mooncake_script(Path(__file__).parent / "mooncake_drain.py", str(tiny_chat_model), str(tmp_path))
    assert res["pin_status"] == 200 and res["salted_pin_status"] == 200 and all(res["refs_cold"]), res
    assert res["drain_status"] == 200, res
    drain = res["drain"]
    w = drain["worker"]
    assert w["l3"] and w["written_pages"] > 0 and w["not_written"] == 0 and w["aborted"] == 0, drain
    # a tenant's session and a tenant's salted lease are re-homed too (x-hicache-tenant, request_salt)
    assert drain["sessions_moved"] == 4 and drain["leases_moved"] == 3 and drain["not_moved"] == [], drain
    assert res["bp_before"]["pinned_tokens"] == 144 and res["bp_before"]["cache_creation_tokens"] > 0, res
    # the breakpoint lease re-homed as one (marked, adopted by B): the same breakpoint there refreshes it
    assert res["bp_after"]["pinned_tokens"] == 144 and res["bp_after"]["cache_creation_tokens"] == 0, res
    assert res["bp_leases_on_b"] == [True], res
    assert res["a_refuses"] == 503 and "draining" in res["a_refusal_text"], res
    assert res["a_integrity"]["ok"] and res["a_integrity"]["running"] == 0, res["a_integrity"]
    assert res["workers_after"] == [True], res  # A left the pool; B alone
    for i, (turn, held) in enumerate(zip(res["turn2"], res["held_on_a"], strict=True)):
        assert turn["status"] == 200, res
        assert turn["cached"] == held > 0, (i, res["turn2"], res["held_on_a"])  # the previous context...
        # ...from L3 (session 0's first pages are the re-homed lease's prefix: B prefetched them to L2)
        assert turn["storage"] == held - (90 // 16 * 16 if i == 0 else 0), (i, res["turn2"], res["held_on_a"])
    assert all(res["same_as_cold"]), res  # identical greedy answers (fp32)
    assert res["unpin_status"] == 200, res  # the re-homed lease answers to its old id
    assert res["salted_on_b"] >= res["salted_pinned"] > 0, res  # alice's salted prefix is held on B...
    assert res["salted_unpin_by_bob"] == 404 and res["salted_unpin"] == 200, res  # ...as hers
    assert res["b_integrity"], res
    assert res["exit_codes"] == [0, 0] and not res["a_log_tracebacks"], res


def test_tenant_header_needs_the_admin_key(tmp_path, tiny_chat_model):
    """``x-hicache-tenant`` (what a router re-homes a tenant's sessions and leases with) acts as that
    tenant with the server's --api-key only: a tenant's key with it is a 403, whichever tenant it
    names (its own too), and an unknown name is a 400."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(json.dumps({"keys": {"sk-alice-hdr-1": "alice", "sk-bob-hdr-1": "bob"}}))
    args = ["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--page-size", "16",
            "--api-keys-file", str(keys)]
    s = ServerProcess(args, "sk-admin-hdr-1")
    s.start()
    try:
        def call(key: str, tenant: str | None, path: str = "/open_session", body: dict | None = None) -> httpx.Response:
            h = {"authorization": f"Bearer {key}", **({"x-hicache-tenant": tenant} if tenant else {})}
            return httpx.post(s.url + path, json=body or {}, headers=h, timeout=60)

        for name in ("alice", "bob"):  # bob's key acting as alice, or as himself: refused before the route
            r = call("sk-bob-hdr-1", name)
            assert r.status_code == 403 and "x-hicache-tenant" in r.text, r.text
        ids = {"input_ids": list(range(100, 140))}
        assert call("sk-bob-hdr-1", "alice", "/cache/pin", {**ids, "ttl_s": 60}).status_code == 403
        assert call("sk-bob-hdr-1", "alice", "/generate", ids).status_code == 403
        r = call("sk-admin-hdr-1", "nobody")
        assert r.status_code == 400 and "no such tenant" in r.text, r.text
        sid = call("sk-admin-hdr-1", "alice", body={"session_id": "moved-1"})  # as a drain re-homes one
        assert sid.status_code == 200 and sid.json() == "moved-1", sid.text
        gen = {**ids, "session_id": "moved-1", "sampling_params": {"max_new_tokens": 2}}
        assert call("sk-bob-hdr-1", None, "/generate", gen).status_code == 404  # not bob's
        assert call("sk-admin-hdr-1", None, "/generate", gen).status_code == 404  # nor the default tenant's
        assert call("sk-alice-hdr-1", None, "/generate", gen).status_code == 200  # alice's
    finally:
        code = s.stop()
    assert code == 0, s.log()


def test_breakpoint_leases_are_marked_and_adopted(tiny_chat_model):
    """The drain report marks a cache_control breakpoint's lease (``breakpoint: true``); a pin with
    ``breakpoint: true`` (what a drain's target is re-pinned with, router/worker_drain.py) is adopted as
    the tenant's breakpoint of that prefix: a later request's breakpoint on it refreshes that
    lease instead of pinning a second one."""
    args = ["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--page-size", "16",
            "--hicache-ratio", "2"]
    s = ServerProcess(args)
    s.start()
    try:
        def gen(ids: list[int], cc: bool) -> dict:
            body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1},
                    **({"cache_control": {"type": "ephemeral"}} if cc else {})}
            r = httpx.post(s.url + "/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["meta_info"]

        bp = [(k * 37) % 30000 + 200 for k in range(100)]
        assert gen(bp, True)["cache_control"]["pinned_tokens"] == 96
        moved = [(k * 53) % 30000 + 300 for k in range(100)]
        gen(moved, False)
        pin = httpx.post(s.url + "/cache/pin", json={"input_ids": moved[:96], "ttl_s": 300, "breakpoint": True},
                         timeout=30)
        assert pin.status_code == 200, pin.text
        cc = gen(moved, True)["cache_control"]  # its breakpoint: the adopted lease, refreshed
        assert cc["pinned_tokens"] == 96 and cc["cache_creation_tokens"] == 0, cc
        rep = httpx.post(s.url + "/drain", timeout=60).json()
        leases = {tuple(x["input_ids"]): x for x in rep["leases"]}
        assert len(rep["leases"]) == 2, rep["leases"]  # no second lease on the adopted prefix
        assert leases[tuple(bp[:96])]["breakpoint"] and leases[tuple(moved[:96])]["breakpoint"], rep["leases"]
        assert leases[tuple(moved[:96])]["lease_id"] == pin.json()["lease_id"]
        assert s.check_integrity()["ok"]
    finally:
        code = s.stop()
    assert code == 0, s.log()


def test_drain_on_one_worker_then_sigterm(tmp_path, tiny_chat_model):
    args = ["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--page-size", "16",
            "--hicache-storage-backend", "lmdb", "--hicache-storage-backend-extra-config",
            json.dumps({"path": str(tmp_path / "l3"), "capacity_gb": 1}), "--drain-on-shutdown"]
    s = ServerProcess(args)
    s.start()
    try:
        ids = [(k * 131) % 30000 + 100 for k in range(200)]
        slow = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}}
        done: list[httpx.Response] = []
        t = threading.Thread(target=lambda: done.append(httpx.post(s.url + "/generate", json=slow, timeout=120)))
        t.start()
        while httpx.get(s.url + "/get_load", timeout=10).json()["load"] == 0 and t.is_alive():
            time.sleep(0.01)  # until the request runs (or is done: the drain then finds nothing running)
        bad = httpx.post(s.url + "/drain", json={"timeout_s": "soon"}, timeout=30)
        assert bad.status_code == 400 and "timeout_s" in bad.text
        r = httpx.post(s.url + "/drain", json={"timeout_s": 120}, timeout=180)
        assert r.status_code == 200, r.text
        t.join()
        assert done[0].status_code == 200 and len(done[0].json()["output_ids"]) == 64  # it finished
        rep = r.json()
        assert rep["draining"] and rep["aborted"] == 0 and rep["l3"], rep
        assert rep["written_pages"] > 0 and rep["not_written"] == 0 and rep["l3_pages"] == rep["tree_pages"], rep
        refused = httpx.post(s.url + "/generate", json=slow, timeout=30)
        assert refused.status_code == 503 and "draining" in refused.text, refused.text
        opened = httpx.post(s.url + "/open_session", json={}, timeout=30)
        assert opened.status_code == 503 and "draining" in opened.text, opened.text
        health = httpx.get(s.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["draining"] is True
        again = httpx.post(s.url + "/drain", timeout=30).json()  # a second drain reports again: nothing left
        assert again["written_pages"] == 0 and again["not_written"] == 0, again
        assert s.check_integrity()["ok"]
    finally:
        code = s.stop()
    assert code == 0, s.log()
    assert "drained:" in s.log() and "Traceback" not in s.log(), s.log()


@pytest.mark.slow
def test_router_sees_a_worker_drain_itself(tiny_chat_model):
    """The worker is drained directly (POST /drain on it, as a SIGTERM with --drain-on-shutdown
    would): the router's health check sees /health 503 {"draining": true}, re-homes the worker's
    sessions on the other worker and removes it; the sessions' next requests are served there."""
    from harness.server_utils import start_all
    from router.config import RouterConfig
    from router.embedded import RouterThread

    args = ["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--max-total-tokens", "4096"]
    a, b = ServerProcess(args), ServerProcess(args)
    start_all(a, b)
    router = RouterThread(RouterConfig(worker_urls=(a.url,), health_check_interval_s=0.2,
                                       enable_worker_registration=True)).start()  # keyless: /add_worker needs it
    try:
        sids = [httpx.post(router.url + "/open_session", json={}, timeout=30).json() for _ in range(2)]
        body = {"input_ids": list(range(100, 140)), "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
        for sid in sids:
            r = httpx.post(router.url + "/generate", json={**body, "session_id": sid}, timeout=60)
            assert r.status_code == 200 and r.headers["x-hicache-worker"] == a.url, r.text
        httpx.post(router.url + "/add_worker", params={"url": b.url}, timeout=30).raise_for_status()
        rep = httpx.post(a.url + "/drain", timeout=60).json()
        assert {s["session_id"] for s in rep["sessions"]} == set(sids) and not rep["l3"], rep
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            urls = [w["url"] for w in httpx.get(router.url + "/list_workers", timeout=10).json()["workers"]]
            if urls == [b.url]:
                break
            time.sleep(0.1)
        assert urls == [b.url], urls
        for sid in sids:  # open on B now (a session unknown there would be a 404)
            r = httpx.post(router.url + "/generate", json={**body, "session_id": sid}, timeout=60)
            assert r.status_code == 200 and r.headers["x-hicache-worker"] == b.url, r.text
        assert a.check_integrity()["ok"] and b.check_integrity()["ok"]
    finally:
        router.stop()
        codes = [s.stop() for s in (a, b)]
    assert codes == [0, 0], a.log()[-3000:]
