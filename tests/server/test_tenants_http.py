"""Tenants and per-request cache_salt through the real server: two tenants with identical prompts
share nothing (cached_tokens 0, disjoint cache-event and L3 keys), a tenant shares with itself,
a request cannot reach another tenant's space by its cache_salt, wrong keys are 401."""

from __future__ import annotations

import httpx
import pytest
import yaml

from harness.server_utils import ROOT, running_server
from hicache import salt
from hicache.keys import page_keys
from hicache.tiers.storage import make_storage
from serving.server.tenants import effective_salt, parse_tenants

ADMIN = "admin-key-0001"
KEYS = {
    "salt_secret": "a-test-secret-of-some-length",
    "keys": {"sk-alice-0001": "alice", "sk-alice-0002": "alice",
             "sk-bob-00001": {"tenant": "bob", "quota_pages": {"L1": 10000}}},
}
PROMPT = [(7 * i + 3) % 500 + 10 for i in range(70)]  # 4 full pages of 16
PS = 16


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    cfg = yaml.safe_load((ROOT / "configs" / "l3.yaml").read_text())
    cfg["cache"]["hicache_storage_backend_extra_config"] = {"path": str(tmp / "l3"), "capacity_gb": 0.05}
    (tmp / "l3.yaml").write_text(yaml.safe_dump(cfg))
    (tmp / "keys.yaml").write_text(yaml.safe_dump(KEYS))
    args = ["--config", str(tmp / "l3.yaml"), "--model-path", str(tiny_chat_model), "--max-total-tokens", "2048",
            "--context-length", "512", "--api-keys-file", str(tmp / "keys.yaml"), "--enable-cache-events"]
    with running_server(args, api_key=ADMIN) as s:
        s.tmp = tmp
        yield s


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


def test_cache_events_and_l3_keys_are_per_tenant(server):
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
