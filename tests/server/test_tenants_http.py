"""Tenants and per-request cache_salt through the real server: two tenants with identical prompts
share nothing (cached_tokens 0, disjoint cache-event and L3 keys), a tenant shares with itself,
a request cannot reach another tenant's space by its cache_salt, wrong keys are 401.

Admin routes (issue 42: findings 1, 4, 10, 12) need the admin key, the server's --api-key: a
tenant's key cannot drain, undrain, flush, read /metrics, /get_server_info, /cache_events or
/debug/*; a drain's report carries no tenant seed; /undrain ends a drain (409 while one runs);
/drain reads its body as every JSON route. Session ids and rids are per tenant (finding 9)."""

from __future__ import annotations

import collections
import json
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import yaml

from common.tenants import effective_salt, parse_tenants
from harness.server_utils import ROOT, ServerProcess, running_server
from hicache import salt
from hicache.keys import page_keys
from hicache.tiers.storage import make_storage
from serving.engine.debug_hooks import HOLD_ENV

ADMIN = "admin-key-0001"
KEYS = {
    "salt_secret": "a-test-secret-of-some-length",
    "keys": {"sk-alice-0001": "alice", "sk-alice-0002": "alice",
             "sk-bob-00001": {"tenant": "bob", "quota_pages": {"L1": 10000}}},
}
PROMPT = [(7 * i + 3) % 500 + 10 for i in range(70)]  # 4 full pages of 16
PS = 16


LIMIT = 2**19  # --max-request-bytes
HELD = f"{HOLD_ENV}: step held"


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    cfg = yaml.safe_load((ROOT / "configs" / "l3.yaml").read_text())
    cfg["cache"]["hicache_storage_backend_extra_config"] = {"path": str(tmp / "l3"), "capacity_gb": 0.05}
    (tmp / "l3.yaml").write_text(yaml.safe_dump(cfg))
    (tmp / "keys.yaml").write_text(yaml.safe_dump(KEYS))
    args = ["--config", str(tmp / "l3.yaml"), "--model-path", str(tiny_chat_model), "--max-total-tokens", "2048",
            "--context-length", "512", "--api-keys-file", str(tmp / "keys.yaml"), "--enable-cache-events",
            "--max-request-bytes", str(LIMIT)]
    s = ServerProcess(args, ADMIN)
    s.tmp, s.hold = tmp, tmp / "hold-step"
    s.env[HOLD_ENV] = str(s.hold)  # while this file exists, engine steps wait (serving/engine/debug_hooks.py)
    s.lines = collections.deque(maxlen=100_000)  # every line: held steps are counted
    s.start()
    try:
        yield s
    finally:
        s.hold.unlink(missing_ok=True)
        code = s.stop()
    assert code == 0 and "Traceback" not in s.log(), s.log()[-3000:]


def gen(server, key: str, ids=PROMPT, **extra) -> httpx.Response:
    return httpx.post(server.url + "/generate", headers={"Authorization": f"Bearer {key}"}, timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **extra})


def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


def test_wrong_or_missing_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer sk-alice-0003"}, {"Authorization": "Bearer sk-alice-000"},
                    {"Authorization": "Basic sk-alice-0001"}):
        r = httpx.post(server.url + "/generate", headers=headers, json={"input_ids": [1, 2]}, timeout=30)
        assert r.status_code == 401, r.text
        assert "API key" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200


def test_tenants_share_nothing_and_themselves_everything(server):
    p = [t + 1 for t in PROMPT]
    assert cached(gen(server, "sk-alice-0001", p)) == 0
    first = gen(server, "sk-alice-0002", p)  # another key of the same tenant shares
    assert cached(first) == 64
    bob = gen(server, "sk-bob-00001", p)
    assert cached(bob) == 0 and bob.json()["output_ids"] == first.json()["output_ids"]
    assert cached(gen(server, "sk-bob-00001", p)) == 64
    assert cached(gen(server, ADMIN, p)) == 0  # the default tenant is a space of its own
    # bob cannot pick alice's space: not by her name, nor by anything else
    for s in ("alice", "tenant:alice", salt.combine("alice", None)):
        assert cached(gen(server, "sk-bob-00001", p, cache_salt=s)) == 0
    # a tenant subdivides its own space with cache_salt
    assert cached(gen(server, "sk-alice-0001", p, cache_salt="project-x")) == 0
    assert cached(gen(server, "sk-alice-0002", p, cache_salt="project-x")) == 64
    assert cached(gen(server, "sk-bob-00001", p, cache_salt="project-x")) == 0
    server.check_integrity()


def test_cache_salt_on_openai_routes(server):
    h = {"Authorization": f"Bearer {ADMIN}"}
    model = server.args[server.args.index("--model-path") + 1].rstrip("/").rsplit("/", 1)[-1]
    text = "The quick brown fox jumps over the lazy dog. " * 8

    def completion(**extra) -> int:
        r = httpx.post(server.url + "/v1/completions", headers=h, timeout=60, json={
            "model": model, "prompt": text, "max_tokens": 2, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def chat(**extra) -> int:
        r = httpx.post(server.url + "/v1/chat/completions", headers=h, timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0,
            **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for call in (completion, chat):
        assert call(cache_salt="s1") == 0
        assert call(cache_salt="s1") > 0
        assert call(cache_salt="s2") == 0
        assert call() == 0
        assert call() > 0


@pytest.mark.parametrize("bad", ["", "x" * (salt.MAX_SALT_CHARS + 1), 12, ["a"]])
def test_bad_cache_salt_is_400(server, bad):
    r = gen(server, ADMIN, cache_salt=bad)
    assert r.status_code == 400, r.text
    assert "cache_salt" in r.text


ALICE, BOB = "sk-alice-0001", "sk-bob-00001"


def call(server, method: str, path: str, key: str, body=None, **kw) -> httpx.Response:
    return httpx.request(method, server.url + path, headers={"Authorization": f"Bearer {key}", **kw.pop("headers", {})},
                         json=body, timeout=120, **kw)


def message(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


class Call(threading.Thread):
    """An HTTP call on a thread (one held behind an engine step)."""

    def __init__(self, fn, *args, **kw) -> None:
        super().__init__(daemon=True)
        self.fn, self.args, self.kw, self.response = fn, args, kw, None

    def run(self) -> None:
        self.response = self.fn(*self.args, **self.kw)

    def result(self) -> httpx.Response:
        self.join(120)
        assert self.response is not None, "the call did not end"
        return self.response


@contextmanager
def held_steps(server):
    """Engine steps wait while inside; yields a function that returns once a step is held."""
    before = server.log().count(HELD)
    server.hold.touch()

    def wait() -> None:
        deadline = time.monotonic() + 60
        while server.log().count(HELD) <= before:
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.02)

    try:
        yield wait
    finally:
        server.hold.unlink(missing_ok=True)


ADMIN_ROUTES = [("GET", "/metrics", None), ("GET", "/get_server_info", None), ("GET", "/server_info", None),
                ("GET", "/cache_events", None), ("POST", "/flush_cache", None),
                ("POST", "/debug/check_integrity", None), ("POST", "/debug/advance_kv_clock", {"seconds": 0}),
                ("POST", "/undrain", None), ("POST", "/drain", {"timeout_s": 0})]


def test_tenant_cannot_flush_the_cache(server):  # finding 4 (the key part)
    r = call(server, "POST", "/flush_cache", BOB)
    assert r.status_code == 403 and "needs the admin key (the server's --api-key)" in message(r), r.text
    assert call(server, "POST", "/flush_cache", ADMIN).json()["success"] is True


def test_metrics_and_server_info_are_the_admins(server):  # finding 10, and every other admin route
    for method, path, body in ADMIN_ROUTES:
        r = call(server, method, path, ALICE, body)
        assert r.status_code == 403 and f"{path} needs the admin key" in message(r), (path, r.text)
    for path in ("/metrics", "/get_server_info", "/server_info", "/cache_events"):
        assert call(server, "GET", path, ADMIN).status_code == 200, path
    load = call(server, "GET", "/get_load", ALICE)  # counts only: every key's (a router balances on it)
    assert load.status_code == 200 and set(load.json()) == {"running", "waiting", "load"}, load.text
    assert call(server, "GET", "/health", ALICE).status_code == 200


def test_drain_is_the_admins_and_its_report_holds_no_seed(server):  # finding 1
    assert call(server, "POST", "/open_session", ALICE, {"session_id": "drain-a1"}).json() == "drain-a1"
    p = [t + 5 for t in PROMPT]
    assert gen(server, ALICE, p, cache_salt="alice-proj").status_code == 200
    pin = call(server, "POST", "/cache/pin", ALICE, {"input_ids": p, "cache_salt": "alice-proj", "ttl_s": 600})
    assert pin.status_code == 200, pin.text
    r = call(server, "POST", "/drain", BOB, {"timeout_s": 0})
    assert r.status_code == 403 and "needs the admin key" in message(r), r.text
    assert call(server, "GET", "/health", BOB).status_code == 200 and gen(server, ALICE).status_code == 200
    r = call(server, "POST", "/drain", ADMIN, {"timeout_s": 0})
    assert r.status_code == 200, r.text
    rep = r.json()
    assert {"session_id": "drain-a1", "tenant": "alice", "retention": {}} in rep["sessions"], rep
    [lease] = [x for x in rep["leases"] if x["lease_id"] == pin.json()["lease_id"]]
    # what a router needs to re-pin it (router/worker_drain.py), and no effective salt
    assert set(lease) == {"lease_id", "breakpoint", "tenant", "input_ids", "request_salt", "ttl_s"}, lease
    assert lease["input_ids"] == p and lease["request_salt"] == "alice-proj" and lease["tenant"] == "alice", lease
    for t in parse_tenants(KEYS).tenants.values():
        assert t.seed not in r.text
    assert call(server, "GET", "/health", ADMIN).json()["draining"] is True
    assert gen(server, ALICE).status_code == 503
    r = call(server, "POST", "/undrain", BOB)
    assert r.status_code == 403 and "needs the admin key" in message(r), r.text
    r = call(server, "POST", "/undrain", ADMIN)
    assert r.status_code == 200 and r.json() == {"draining": False}, r.text
    assert call(server, "GET", "/health", ADMIN).status_code == 200 and gen(server, ALICE).status_code == 200
    assert call(server, "DELETE", f"/cache/pin/{pin.json()['lease_id']}", ALICE).status_code == 200
    assert call(server, "POST", "/close_session", ALICE, {"session_id": "drain-a1"}).status_code == 200
    assert server.check_integrity()["ok"]


def test_undrain_waits_for_a_running_drain(server):
    with held_steps(server) as engine_held:
        running = Call(gen, server, ALICE)
        running.start()
        engine_held()  # alice's request is in a step
        drain = Call(call, server, "POST", "/drain", ADMIN, {"timeout_s": 60})
        drain.start()
        while call(server, "GET", "/health", ADMIN).status_code == 200:  # draining: waits for alice's request
            time.sleep(0.02)
        r = call(server, "POST", "/undrain", ADMIN)
        assert r.status_code == 409 and "a drain is still running" in message(r), r.text
    assert running.result().status_code == 200 and drain.result().status_code == 200, drain.result().text
    assert drain.result().json()["aborted"] == 0
    assert call(server, "POST", "/undrain", ADMIN).json() == {"draining": False}
    assert call(server, "GET", "/health", ADMIN).status_code == 200


def test_drain_reads_its_body_as_every_json_route(server):  # finding 12 (the worker's part)
    deep = "[" * 100_000 + "]" * 100_000
    for content, ctype, status, text in (
        (deep, "application/json", 400, "deeper than the limit"),
        ('{"timeout_s": 0}', "text/plain", 415, "Content-Type: application/json"),
        (json.dumps({"timeout_s": 0, "pad": "x" * LIMIT}), "application/json", 413, "limit"),
        ('{"timeout_s": "soon"}', "application/json", 400, "timeout_s"),
        ('{"timeout_s": 4000}', "application/json", 400, "timeout_s"),
        ('{"timeout": 1}', "application/json", 400, "timeout"),
        ("[1]", "application/json", 400, "JSON object"),
    ):
        r = call(server, "POST", "/drain", ADMIN, content=content, headers={"content-type": ctype})
        assert r.status_code == status and text in message(r), (status, r.status_code, r.text[:300])
    assert call(server, "GET", "/health", ADMIN).status_code == 200  # none of them drained


def test_session_ids_and_rids_are_per_tenant(server):  # finding 9
    for key in (ALICE, BOB):  # the same id, each tenant's own
        r = call(server, "POST", "/open_session", key, {"session_id": "sess-shared"})
        assert r.status_code == 200 and r.json() == "sess-shared", r.text
    r = call(server, "POST", "/open_session", ALICE, {"session_id": "sess-shared"})  # her own open id: 409
    assert r.status_code == 409 and message(r).startswith("session_id 'sess-shared' is already open"), r.text
    for key in (ALICE, BOB):
        assert gen(server, key, session_id="sess-shared").status_code == 200
    assert call(server, "POST", "/close_session", ALICE, {"session_id": "sess-shared"}).status_code == 200
    r = call(server, "POST", "/close_session", ALICE, {"session_id": "sess-shared"})
    assert r.status_code == 404 and message(r) == "unknown session_id 'sess-shared'", r.text
    assert gen(server, BOB, session_id="sess-shared").status_code == 200  # bob's is still open
    assert call(server, "POST", "/close_session", BOB, {"session_id": "sess-shared"}).status_code == 200
    with held_steps(server) as engine_held:
        alice = Call(gen, server, ALICE, rid="rid-shared")
        alice.start()
        engine_held()  # alice's request runs (in a held step)
        bob = Call(gen, server, BOB, rid="rid-shared")
        bob.start()
        r = gen(server, ALICE, rid="rid-shared")  # her own running rid: 400, as before
        assert r.status_code == 400 and message(r) == "a request with rid 'rid-shared' is already running", r.text
        bob.join(0.5)  # not refused: it waits for the held step too
    for done in (alice, bob):
        r = done.result()
        assert r.status_code == 200 and r.json()["meta_info"]["id"] == "rid-shared", r.text
    assert server.check_integrity()["ok"]


def test_tenants_without_an_admin_key_have_no_admin_routes(tiny_chat_model, tmp_path):
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump(KEYS))
    args = ["--model-path", str(tiny_chat_model), "--max-total-tokens", "1024", "--context-length", "512",
            "--api-keys-file", str(tmp_path / "keys.yaml")]
    with running_server(args) as s:
        for method, path, body in ADMIN_ROUTES:
            r = call(s, method, path, ALICE, body)
            assert r.status_code == 403 and "no admin key: start it with --api-key" in message(r), (path, r.text)
        assert gen(s, ALICE).status_code == 200 and call(s, "GET", "/get_load", BOB).status_code == 200


def test_cache_events_and_l3_keys_are_per_tenant(server):  # the last: it stops the server
    p = [t + 2 for t in PROMPT]
    for key in ("sk-alice-0001", "sk-bob-00001", "sk-alice-0001", "sk-bob-00001"):  # second round backs up to L2
        gen(server, key, p)
    ev = httpx.get(server.url + "/cache_events", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
    ns = ev["namespace"]
    table = parse_tenants(KEYS)
    alice, bob = (table.tenants[n] for n in ("alice", "bob"))
    ka = page_keys(salt.apply(p, salt.salt_tags(effective_salt(alice, None))), PS, ns)
    kb = page_keys(salt.apply(p, salt.salt_tags(effective_salt(bob, None))), PS, ns)
    k0 = page_keys(p, PS, ns)
    held = set(ev["snapshot"]["L1"]) | set(ev["snapshot"]["L2"])
    assert set(ka) <= held and set(kb) <= held and not set(k0) & held and not set(ka) & set(kb)
    server.check_integrity()
    server.stop()  # persists every cached page to L3
    store = make_storage("lmdb", {"path": str(server.tmp / "l3"), "capacity_gb": 0.05})
    try:
        assert store.batch_exists(ka) == len(ka) and store.batch_exists(kb) == len(kb)
        assert store.batch_exists(k0) == 0
    finally:
        store.close()
