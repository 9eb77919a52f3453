"""The KV control API through the real server: /cache/lookup, /cache/prefetch, /cache/pin (+DELETE)
and /open_session retention hints, tenant-scoped; bad input is a clear 4xx and leaks nothing."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml

from harness.server_utils import ROOT, running_server

ADMIN = "admin-key-0001"
ALICE, BOB, CAROL = "sk-alice-0001", "sk-bob-00001", "sk-carol-001"
KEYS = {"keys": {ALICE: {"tenant": "alice", "quota_pages": {"L2": 8}}, BOB: "bob", CAROL: "carol"}}


def prompt(seed: int, n: int = 70) -> list[int]:
    return [(seed * 131 + 7 * i) % 450 + 30 for i in range(n)]


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvctl")
    cfg = yaml.safe_load((ROOT / "configs" / "l3.yaml").read_text())
    cfg["cache"]["hicache_storage_backend_extra_config"] = {"path": str(tmp / "l3"), "capacity_gb": 0.05}
    (tmp / "l3.yaml").write_text(yaml.safe_dump(cfg))
    (tmp / "keys.yaml").write_text(yaml.safe_dump(KEYS))
    args = ["--config", str(tmp / "l3.yaml"), "--model-path", str(tiny_chat_model), "--max-total-tokens", "1024",
            "--context-length", "512", "--api-keys-file", str(tmp / "keys.yaml")]
    with running_server(args, api_key=ADMIN) as s:
        yield s


def post(server, path: str, key: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, headers={"Authorization": f"Bearer {key}"}, json=body, timeout=60)


def gen(server, key: str, ids: list[int], **extra) -> dict:
    r = post(server, "/generate", key, {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                                        **extra})
    assert r.status_code == 200, r.text
    return r.json()


def lookup(server, key: str, ids: list[int]) -> dict:
    r = post(server, "/cache/lookup", key, {"input_ids": ids})
    assert r.status_code == 200, r.text
    return r.json()["cached_tokens"]


def flood(server, n: int = 30) -> None:
    for j in range(n):  # 30 x 6 pages of carol's, each sent twice (the hit backs it up to L2): more
        gen(server, CAROL, prompt(1000 + j, 100))  # than the 64-page L1 and the 128-page L2 hold
        gen(server, CAROL, prompt(1000 + j, 100))


def test_lookup_is_per_tenant_and_read_only(server):
    p = prompt(1)
    assert lookup(server, ALICE, p) == {"L1": 0, "L2": 0, "L3": 0}
    gen(server, ALICE, p)
    assert lookup(server, ALICE, p)["L1"] == 64
    assert lookup(server, BOB, p) == {"L1": 0, "L2": 0, "L3": 0}
    assert gen(server, BOB, p)["meta_info"]["cached_tokens"] == 0
    r = post(server, "/cache/lookup", ALICE, {"prompt": "hello there " * 20})
    assert r.status_code == 200 and r.json()["prompt_tokens"] > 0, r.text
    r = post(server, "/cache/lookup", ALICE, {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


def test_prefetch_brings_the_prompt_to_l1(server):
    p = prompt(2)
    r = post(server, "/cache/prefetch", ALICE, {"input_ids": p})
    assert r.status_code == 200 and r.json()["resident"] == "L1", r.text
    assert lookup(server, ALICE, p)["L1"] == 64
    assert gen(server, ALICE, p)["meta_info"]["cached_tokens_details"]["device"] == 64


def test_pin_keeps_the_prefix_on_l2_through_a_flood(server):
    pinned, loose = prompt(3), prompt(4)
    gen(server, ALICE, pinned)
    gen(server, ALICE, loose)
    r = post(server, "/cache/pin", ALICE, {"input_ids": pinned, "ttl_s": 600})
    assert r.status_code == 200, r.text
    lease = r.json()
    assert lease["pinned_tokens"] == 64
    flood(server)
    assert server.check_integrity()["ok"]  # the tree's pins and the leases agree
    kept, gone = lookup(server, ALICE, pinned), lookup(server, ALICE, loose)
    assert kept["L1"] + kept["L2"] == 64, kept
    assert gone["L1"] + gone["L2"] == 0, gone  # the control: the flood evicted what was not pinned
    early = lookup(server, CAROL, prompt(1000, 100))  # carol's first prompt: written to L3, then evicted
    assert early == {"L1": 0, "L2": 0, "L3": 96}, early
    assert gen(server, ALICE, pinned)["meta_info"]["cached_tokens"] == 64
    # another tenant cannot release it (nor learn it exists)
    assert httpx.delete(f"{server.url}/cache/pin/{lease['lease_id']}", headers={"Authorization": f"Bearer {BOB}"},
                        timeout=30).status_code == 404
    r = httpx.delete(f"{server.url}/cache/pin/{lease['lease_id']}", headers={"Authorization": f"Bearer {ALICE}"},
                     timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.delete(f"{server.url}/cache/pin/{lease['lease_id']}", headers={"Authorization": f"Bearer {ALICE}"},
                     timeout=30)
    assert r.status_code == 404 and "unknown or expired lease" in r.text


def test_pin_errors(server):
    p, q = prompt(5), prompt(6, 90)
    gen(server, ALICE, p)
    gen(server, ALICE, q)
    r = post(server, "/cache/pin", ALICE, {"input_ids": p, "ttl_s": 3.0})  # outlives the 409 check below
    assert r.status_code == 200, r.text
    short = r.json()["lease_id"]
    r = post(server, "/cache/pin", ALICE, {"input_ids": q, "ttl_s": 60})  # 4 + 5 pages > alice's 8
    assert r.status_code == 409 and "quota" in r.text, r.text
    time.sleep(3.5)  # the short lease has ended: every call expires ended leases first
    r = httpx.delete(f"{server.url}/cache/pin/{short}", headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)
    assert r.status_code == 404 and "expired" in r.text, r.text
    r = post(server, "/cache/pin", ALICE, {"input_ids": q, "ttl_s": 60})  # fits again now
    assert r.status_code == 200, r.text
    assert httpx.delete(f"{server.url}/cache/pin/{r.json()['lease_id']}", headers={"Authorization": f"Bearer {ALICE}"},
                        timeout=30).status_code == 200
    assert post(server, "/cache/pin", BOB, {"input_ids": prompt(7), "ttl_s": 60}).status_code == 404  # nothing cached


@pytest.mark.parametrize(("path", "body", "status", "text"), [
    ("/cache/lookup", {}, 400, "exactly one of prompt, messages or input_ids"),
    ("/cache/lookup", {"input_ids": [1], "prompt": "x"}, 400, "exactly one"),
    ("/cache/lookup", {"input_ids": []}, 400, "the prompt must have"),
    ("/cache/lookup", {"input_ids": [10**9]}, 400, "the prompt must have"),
    ("/cache/lookup", {"input_ids": [1, 2], "cache_salt": ""}, 400, "cache_salt"),
    ("/cache/lookup", {"input_ids": [1, 2], "model": "nope"}, 404, "does not exist"),
    ("/cache/lookup", {"input_ids": [1, 2], "bogus": 1}, 400, "bogus"),
    ("/cache/pin", {"input_ids": [1, 2]}, 400, "ttl_s"),
    ("/cache/pin", {"input_ids": [1, 2], "ttl_s": -1}, 400, "ttl_s"),
    ("/cache/pin", {"input_ids": [1, 2], "ttl_s": 10**9}, 400, "ttl_s"),
    ("/cache/prefetch", {"input_ids": [1, 2], "level": "L3"}, 400, "level"),
    ("/open_session", {"retention": {"ttl_s": -1}}, 400, "retention.ttl_s"),
    ("/open_session", {"retention": {"keep": True}}, 400, "retention.keep"),
    ("/open_session", {"retention": "yes"}, 400, "retention"),
])
def test_bad_input_is_4xx(server, path, body, status, text):
    r = post(server, path, ALICE, body)
    assert r.status_code == status, r.text
    assert text in r.json()["error"]["message"], r.text


def test_wrong_key_and_foreign_sessions(server):
    for path in ("/cache/lookup", "/cache/prefetch", "/cache/pin"):
        assert post(server, path, "sk-nobody-01", {"input_ids": [1, 2], "ttl_s": 1}).status_code == 401
    assert httpx.delete(f"{server.url}/cache/pin/lease-1", timeout=30).status_code == 401
    r = post(server, "/open_session", ALICE, {"session_id": "alice-s1", "retention": {"ttl_s": 60}})
    assert r.status_code == 200 and r.json() == "alice-s1", r.text
    r = post(server, "/generate", BOB, {"input_ids": [1, 2, 3], "session_id": "alice-s1"})
    assert r.status_code == 404 and "unknown session_id" in r.text, r.text
    assert post(server, "/close_session", BOB, {"session_id": "alice-s1"}).status_code == 404
    r = post(server, "/open_session", BOB, {"session_id": "alice-s1"})  # bob's own namespace: his own session
    assert r.status_code == 200 and r.json() == "alice-s1", r.text
    assert post(server, "/close_session", BOB, {"session_id": "alice-s1"}).status_code == 200
    assert post(server, "/generate", ALICE, {"input_ids": [1, 2], "session_id": "nope"}).status_code == 404
    assert post(server, "/close_session", ALICE, {"session_id": "alice-s1"}).status_code == 200
    assert post(server, "/close_session", ALICE, {"session_id": "alice-s1"}).status_code == 404


def test_nothing_leaks(server):
    """After every lease is gone and the cache is flushed, no page of any pool is in use (pages an
    L3 write-back still reads are freed once it is done: a request turns the engine's loop)."""
    body = server.check_integrity()
    assert body["ok"], body
    deadline = time.monotonic() + 20
    while True:
        r = post(server, "/flush_cache", ADMIN, {})
        assert r.status_code == 200, r.text
        body = server.check_integrity()
        assert body["ok"], body
        if body["pages"]["host"]["used"] == 0 or time.monotonic() > deadline:
            break
        gen(server, ADMIN, [1, 2, 3])
        time.sleep(0.5)
    assert body["pages"]["device"]["used"] == 0 and body["pages"]["host"]["used"] == 0, body["pages"]
