"""Sessions and pin leases are bounded (issue 25, findings 8 and 9), through the real server:

- a session id is 1-256 characters of [A-Za-z0-9._:-] wherever it arrives (/open_session,
  /close_session, /generate, /v1/chat/completions): anything else is a 400 naming it;
- opening an open id of one's own is a 409 (another tenant's id is not: each has its own
  namespace); past --max-sessions (or --max-sessions-per-tenant) a 429 naming it;
- a tenant's pin quota counts distinct pages (a prefix pinned by many leases counts once); its
  leases are capped (--max-pin-leases-per-tenant, --max-pin-leases: 429); expiry gives both back.
The engine's integrity check (leases, per-tenant page counts, sessions) holds after each."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml

from harness.server_utils import ROOT, running_server

ADMIN = "admin-key-0001"
ALICE, BOB, CAROL = "sk-alice-0001", "sk-bob-00001", "sk-carol-001"
KEYS = {"keys": {ALICE: {"tenant": "alice", "quota_pages": {"L2": 8}}, BOB: "bob", CAROL: "carol"}}
MAX_SESSIONS, PER_TENANT = 8, 3
MAX_LEASES, LEASES_PER_TENANT = 10, 6


def prompt(seed: int, n: int = 70) -> list[int]:
    return [(seed * 131 + 7 * i) % 450 + 30 for i in range(n)]


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvlimits")
    (tmp / "keys.yaml").write_text(yaml.safe_dump(KEYS))
    args = ["--config", str(ROOT / "configs" / "l1.yaml"), "--model-path", str(tiny_chat_model),
            "--hicache-ratio", "2.0", "--max-total-tokens", "1024", "--context-length", "512",
            "--api-keys-file", str(tmp / "keys.yaml"),
            "--max-sessions", str(MAX_SESSIONS), "--max-sessions-per-tenant", str(PER_TENANT),
            "--max-pin-leases", str(MAX_LEASES), "--max-pin-leases-per-tenant", str(LEASES_PER_TENANT)]
    with running_server(args, api_key=ADMIN) as s:
        yield s


def post(server, path: str, key: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, headers={"Authorization": f"Bearer {key}"}, json=body, timeout=60)


def delete(server, lease_id: str, key: str) -> httpx.Response:
    return httpx.delete(f"{server.url}/cache/pin/{lease_id}", headers={"Authorization": f"Bearer {key}"}, timeout=60)


def message(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


def gen(server, key: str, ids: list[int], **extra) -> httpx.Response:
    return post(server, "/generate", key, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2,
                                                                                  "temperature": 0}, **extra})


def assert_sound(server, sessions: int) -> dict:
    body = server.check_integrity()
    assert body["ok"], body
    assert body["sessions"] == sessions, body
    return body


BAD_IDS = [
    ("a" * 2**20, "has 1048576 characters; at most 256"),
    ("x" * 257, "has 257 characters; at most 256"),
    ("", "must not be empty"),
    ("a\x00b", "may contain only letters, digits and . _ : - (found '\\x00' at position 1)"),
    ("s1\r\nX-Injected: 1", "found '\\r' at position 2"),
    ("../../etc/passwd", "found '/' at position 2"),
    ("two words", "found ' ' at position 3"),
]


@pytest.mark.parametrize(("sid", "why"), BAD_IDS, ids=["1MB", "257", "empty", "nul", "crlf", "dotdot", "space"])
def test_session_ids_are_validated_wherever_they_arrive(server, sid, why):
    model = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {ADMIN}"},
                      timeout=30).json()["data"][0]["id"]
    for path, body in [
        ("/open_session", {"session_id": sid}),
        ("/close_session", {"session_id": sid}),
        ("/generate", {"input_ids": [5, 6, 7], "session_id": sid}),
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 2, "session_id": sid}),
    ]:
        r = post(server, path, ALICE, body)
        assert r.status_code == 400, (path, r.text[:300])
        assert "session_id" in message(r) and why in message(r), (path, message(r)[:300])
    assert_sound(server, sessions=0)


def test_sessions_are_bounded_and_unique(server):
    ok_ids = ["a" * 256, "0123456789abcdef0123456789abcdef", "agent:7.turn_3-x"]  # the longest, uuid hex, punctuation
    for sid in ok_ids:
        r = post(server, "/open_session", ALICE, {"session_id": sid})
        assert r.status_code == 200 and r.json() == sid, r.text
    r = post(server, "/open_session", ALICE, {"session_id": ok_ids[1]})  # its own open id again
    assert r.status_code == 409 and "is already open" in message(r), r.text
    r = post(server, "/open_session", BOB, {"session_id": ok_ids[1]})  # alice's id: bob has his own namespace
    assert r.status_code == 200 and r.json() == ok_ids[1], r.text
    r = post(server, "/open_session", ALICE, {})  # alice's 4th
    assert r.status_code == 429 and f"max_sessions_per_tenant {PER_TENANT}" in message(r), r.text
    bob = [ok_ids[1]] + [post(server, "/open_session", BOB, {}).json() for _ in range(PER_TENANT - 1)]
    opened = []  # the default tenant (the admin key) is bounded by the server-wide cap only
    while len(opened) < 2 * MAX_SESSIONS:
        r = post(server, "/open_session", ADMIN, {})
        if r.status_code != 200:
            break
        opened.append(r.json())
    assert len(opened) == MAX_SESSIONS - 2 * PER_TENANT, opened
    assert r.status_code == 429 and f"max_sessions {MAX_SESSIONS}" in message(r), r.text
    r = post(server, "/open_session", CAROL, {"session_id": "carol-1"})  # under her own cap, over the server's
    assert r.status_code == 429 and f"max_sessions {MAX_SESSIONS}" in message(r), r.text
    assert_sound(server, sessions=MAX_SESSIONS)
    # a full table still serves its sessions; closing one makes room
    assert gen(server, ALICE, prompt(1), session_id=ok_ids[0]).status_code == 200
    assert post(server, "/close_session", ALICE, {"session_id": ok_ids[1]}).status_code == 200
    r = post(server, "/open_session", CAROL, {"session_id": "carol-1"})
    assert r.status_code == 200, r.text
    for key, sids in ((ALICE, [ok_ids[0], ok_ids[2]]), (BOB, bob), (ADMIN, opened), (CAROL, ["carol-1"])):
        for sid in sids:
            r = post(server, "/close_session", key, {"session_id": sid})
            assert r.status_code == 200, r.text
    assert_sound(server, sessions=0)


def test_pins_count_pages_once_and_leases_are_capped(server):
    p = prompt(2)  # 4 full pages of 16
    longer = p[:64] + prompt(3, 26)  # the same 4 pages + 1 more
    other = prompt(4, 90)  # 5 pages of its own
    for ids in (p, longer, other):
        assert gen(server, ALICE, ids).status_code == 200
    leases = []
    for _ in range(LEASES_PER_TENANT - 1):  # 5 x the same 4 pages: 4 pages of alice's 8-page pin quota
        r = post(server, "/cache/pin", ALICE, {"input_ids": p, "ttl_s": 600})
        assert r.status_code == 200 and r.json()["pinned_tokens"] == 64, r.text
        leases.append(r.json()["lease_id"])
    r = post(server, "/cache/pin", ALICE, {"input_ids": longer, "ttl_s": 600})  # 1 page more: 5 of 8
    assert r.status_code == 200 and r.json()["pinned_tokens"] == 80, r.text
    leases.append(r.json()["lease_id"])
    r = post(server, "/cache/pin", ALICE, {"input_ids": p, "ttl_s": 600})  # costs no page, but a 7th lease
    assert r.status_code == 429 and f"max_pin_leases_per_tenant {LEASES_PER_TENANT}" in message(r), r.text
    assert delete(server, leases.pop(), ALICE).status_code == 200  # back to 4 pages in 5 leases
    r = post(server, "/cache/pin", ALICE, {"input_ids": other, "ttl_s": 600})  # 4 + 5 new pages > 8
    assert r.status_code == 409 and "8-page pin quota (4 pinned)" in message(r), r.text
    assert server.check_integrity()["ok"]
    # the server-wide cap: bob's leases fill it (the default tenant's too)
    assert gen(server, BOB, p).status_code == 200
    bobs = []
    for _ in range(MAX_LEASES - len(leases)):
        r = post(server, "/cache/pin", BOB, {"input_ids": p, "ttl_s": 600})
        assert r.status_code == 200, r.text
        bobs.append(r.json()["lease_id"])
    for key in (BOB, ADMIN):
        gen(server, key, p)
        r = post(server, "/cache/pin", key, {"input_ids": p, "ttl_s": 600})
        assert r.status_code == 429 and f"max_pin_leases {MAX_LEASES}" in message(r), r.text
    for lease in bobs:
        assert delete(server, lease, BOB).status_code == 200
    # expiry gives pages and leases back: alice's leases end, then the 5-page prefix fits
    for lease in leases:
        assert delete(server, lease, ALICE).status_code == 200
    short = [post(server, "/cache/pin", ALICE, {"input_ids": p, "ttl_s": 0.5}) for _ in range(LEASES_PER_TENANT - 1)]
    assert all(r.status_code == 200 for r in short), [r.text for r in short]
    r = post(server, "/cache/pin", ALICE, {"input_ids": other, "ttl_s": 600})
    assert r.status_code == 409 and "(4 pinned)" in message(r), r.text
    time.sleep(0.6)  # past every short lease's ttl_s (counted from before its answer): the next call ends them
    r = post(server, "/cache/pin", ALICE, {"input_ids": other, "ttl_s": 600})
    assert r.status_code == 200 and r.json()["pinned_tokens"] == 80, r.text
    body = server.check_integrity()
    assert body["ok"], body
    assert delete(server, r.json()["lease_id"], ALICE).status_code == 200
    assert all(delete(server, x.json()["lease_id"], ALICE).status_code == 404 for x in short)  # expired
    assert server.check_integrity()["ok"]
