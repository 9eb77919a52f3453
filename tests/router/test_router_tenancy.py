"""Router pieces of tenant isolation and fleet scale (unit): scoped routing keys, a failed
attempt taken back from the routing tree, bounded session / lease / page maps with counters,
shared-L3 credit in the exact view, tenant keys; then end to end: two real workers behind the
router with tenants, the KV control API forwarded to the worker that holds the prefix."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import yaml

from common.tenants import parse_tenants
from harness.server_utils import ServerProcess, start_all
from hicache import salt
from hicache.keys import page_keys
from router.approx_tree import ApproxTree, token_key
from router.cache_view import CacheView, WorkerCache
from router.config import RouterConfig
from router.embedded import RouterThread
from router.tenancy import BoundedMap, Tenancy, scope_of, scope_prefix, session_key

KEYS = {"keys": {"sk-alice-0001": "alice", "sk-bob-00001": "bob"}}


def test_retract_takes_back_only_what_the_failed_attempt_added():
    t = ApproxTree()
    t.insert("abc", "w1")
    keep = t.match("abcdef", ("w1",))[0]
    t.insert("abcdef", "w1")
    assert t.retract("abcdef", "w1", keep) == 3
    assert t.match("abcdef", ("w1",))[0] == 3 and t.sizes["w1"] == 3
    t.insert("xyz", "w2")
    assert t.retract("xyz", "w2", 0) == 3 and t.match("xyz")[0] == 0 and t.sizes["w2"] == 0
    # a node the tenant also holds below through another request keeps it
    t.insert("abcQQ", "w1")
    t.insert("abcRR", "w1")
    assert t.retract("abcQQ", "w1", 3) == 2 and t.match("abcRR", ("w1",))[0] == 5


def test_scopes_partition_keys_and_sessions():
    table = parse_tenants(KEYS)
    alice, bob = table.tenants["alice"], table.tenants["bob"]
    sa, sb = scope_of(alice, {}), scope_of(bob, {"cache_salt": "x"})
    assert sa != sb and scope_of(None, {}) is None and scope_of(alice, {"cache_salt": "x"}) != sa
    ka, kb = scope_prefix(sa) + token_key([1, 2, 3]), scope_prefix(sb) + token_key([1, 2, 3])
    t = ApproxTree()
    t.insert(ka, "w1")
    assert t.match(kb)[0] == 0 and t.match(token_key([1, 2, 3]))[0] == 0
    assert session_key(sa, "s") != session_key(sb, "s") and session_key(None, "s") == "s"


def test_tenancy_keys():
    ten = Tenancy("admin-key-0001", None)
    assert ten.authenticate("Bearer admin-key-0001") == (True, None)
    assert ten.authenticate("bearer admin-key-0002")[0] is False
    assert ten.authenticate("Basic admin-key-0001")[0] is False


def test_bounded_map_counts_what_it_drops():
    m = BoundedMap(2)
    m["a"], m["b"] = 1, 2
    assert m.get("a") == 1  # read: most recent now
    m["c"] = 3
    assert list(m) == ["a", "c"] and m.evicted == 1


def test_exact_view_caps_pages_and_credits_shared_l3():
    ns, ps = "ns", 4
    ids = list(range(40))
    keys = page_keys(ids, ps, ns)
    view = CacheView(None, {}, 1.0, l2_weight=0.5, shared_l3_weight=0.25, max_pages=6)  # type: ignore[arg-type]
    view.caches["a"] = WorkerCache(epoch="e", namespace=ns, page_size=ps, max_pages=6)
    view.caches["a"].apply("add", "L2", keys[:8])
    assert len(view.caches["a"].pages) == 6 and view.caches["a"].dropped == 2
    view.caches["a"] = WorkerCache(epoch="e", namespace=ns, page_size=ps, l3=view.l3)
    view.caches["b"] = WorkerCache(epoch="e", namespace=ns, page_size=ps, l3=view.l3)
    view.caches["a"].apply("add", "L1", keys[:2])
    view.caches["a"].apply("add", "L2", keys[:6])
    urls = {"a": None, "b": None}
    s = view.scores(ids, urls)
    assert s["a"] == (2 + 4 * 0.5) * ps and s["b"] == 6 * ps * 0.25
    view.caches["a"].apply("remove", "L2", keys[:6])  # a evicts it from L2: the shared L3 keeps it
    assert view.scores(ids, urls)["b"] == 6 * ps * 0.25 and len(view.l3) == 6
    view.shared_l3_weight = 0.0
    assert "b" not in view.scores(ids, urls)


# -- end to end ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet(tiny_chat_model, tmp_path_factory) -> Iterator[tuple[list[ServerProcess], RouterThread]]:
    tmp = tmp_path_factory.mktemp("rt")
    (tmp / "keys.yaml").write_text(yaml.safe_dump(KEYS))
    args = ["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--max-total-tokens", "4096",
            "--hicache-ratio", "2", "--api-keys-file", str(tmp / "keys.yaml"), "--enable-cache-events"]
    workers = [ServerProcess(args, api_key="admin-key-0001") for _ in range(2)]
    start_all(*workers)
    cfg = RouterConfig(worker_urls=tuple(w.url for w in workers), health_check_interval_s=0.5,
                       api_key="admin-key-0001", api_keys_file=str(tmp / "keys.yaml"), cache_view="events",
                       tokenizer_workers=1)
    try:
        with RouterThread(cfg) as r:
            yield workers, r
    finally:
        for w in workers:
            w.stop()


def gen(url: str, key: str, ids: list[int], **extra) -> httpx.Response:
    return httpx.post(url + "/generate", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, **extra})


@pytest.mark.slow
def test_router_with_tenants(fleet):
    workers, r = fleet
    p = [(13 * i + 5) % 400 + 20 for i in range(80)]
    a1 = gen(r.url, "sk-alice-0001", p)
    assert a1.status_code == 200 and a1.json()["meta_info"]["cached_tokens"] == 0, a1.text
    a2 = gen(r.url, "sk-alice-0001", p)
    assert a2.json()["meta_info"]["cached_tokens"] == 64
    assert a2.headers["x-hicache-worker"] == a1.headers["x-hicache-worker"]
    b = gen(r.url, "sk-bob-00001", p)
    assert b.status_code == 200 and b.json()["meta_info"]["cached_tokens"] == 0
    assert gen(r.url, "sk-nobody-001", p).status_code == 401
    h = {"Authorization": "Bearer sk-alice-0001"}
    # the control API reaches the worker that holds alice's prefix
    look = httpx.post(r.url + "/cache/lookup", headers=h, json={"input_ids": p}, timeout=30)
    assert look.status_code == 200 and look.json()["cached_tokens"]["L1"] == 80, look.text
    assert look.headers["x-hicache-worker"] == a1.headers["x-hicache-worker"]
    pin = httpx.post(r.url + "/cache/pin", headers=h, json={"input_ids": p, "ttl_s": 60}, timeout=30)
    assert pin.status_code == 200, pin.text
    lease = pin.json()["lease_id"]
    bob_del = httpx.delete(f"{r.url}/cache/pin/{lease}", headers={"Authorization": "Bearer sk-bob-00001"},
                           timeout=30)
    assert bob_del.status_code == 404
    assert httpx.delete(f"{r.url}/cache/pin/{lease}", headers=h, timeout=30).status_code == 200
    assert httpx.delete(f"{r.url}/cache/pin/{lease}", headers=h, timeout=30).status_code == 404
    pre = httpx.post(r.url + "/cache/prefetch", headers=h, json={"prompt": "an agent's next turn " * 10},
                     timeout=60)
    assert pre.status_code == 200, pre.text
    # a session sticks to its worker, in its tenant's scope
    sid = httpx.post(r.url + "/open_session", headers=h, json={}, timeout=30).json()
    homes = {gen(r.url, "sk-alice-0001", p[:40] + [i], session_id=sid).headers["x-hicache-worker"]
             for i in range(3)}
    assert len(homes) == 1
    assert httpx.post(r.url + "/close_session", headers={"Authorization": "Bearer sk-bob-00001"},
                      json={"session_id": sid}, timeout=30).status_code == 404
    assert httpx.post(r.url + "/close_session", headers=h, json={"session_id": sid}, timeout=30).status_code == 200
    admin = {"Authorization": "Bearer admin-key-0001"}  # /list_workers is an admin route
    listing = httpx.get(r.url + "/list_workers", headers=admin, timeout=30).json()
    assert listing["fleet"]["keyed_off_loop"] >= 1, listing["fleet"]
    # an attempt the worker refused leaves nothing behind in the routing tree
    before = listing["policy_stats"]["tree_sizes"]
    bad = gen(r.url, "sk-alice-0001", [10**6] * 50)
    assert bad.status_code == 400, bad.text
    after = httpx.get(r.url + "/list_workers", headers=admin, timeout=30).json()["policy_stats"]
    assert after["tree_sizes"] == before and after["retracted"] >= 50, after
    for w in workers:
        assert w.check_integrity()["ok"]
    assert salt.SALTED_TOKENS == 4


@pytest.mark.slow
def test_router_forwards_anthropic_and_ollama(fleet):
    """Anthropic's /v1/messages (key in x-api-key) and Ollama's /api/* through the router: routed on
    the prompt the worker will prefill, so a repeated conversation returns to the worker that holds it."""
    import anthropic
    import ollama

    _, r = fleet
    system, msgs = "You answer briefly.", [{"role": "user", "content": "Name three colours, then three fruits."}]
    client = anthropic.Anthropic(base_url=r.url, api_key="sk-alice-0001", max_retries=0)
    first = client.messages.with_raw_response.create(model="tiny", system=system, messages=msgs, max_tokens=4,
                                                     extra_body={"temperature": 0})
    again = client.messages.with_raw_response.create(model="tiny", system=system, messages=msgs, max_tokens=4,
                                                     extra_body={"temperature": 0})
    home = first.headers["x-hicache-worker"]
    assert again.headers["x-hicache-worker"] == home
    a1, a2 = first.parse(), again.parse()
    assert a2.content[0].text == a1.content[0].text and a2.usage.cache_read_input_tokens >= 16, a2.usage
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=r.url, api_key="sk-nobody-001", max_retries=0).messages.create(
            model="tiny", messages=msgs, max_tokens=4)
    # Ollama streams by default: NDJSON through the router; alice's scope: the same worker again
    body = {"model": "tiny", "messages": [{"role": "system", "content": system}, *msgs],
            "options": {"temperature": 0, "num_predict": 4}}
    with httpx.stream("POST", r.url + "/api/chat", json=body, timeout=60,
                      headers={"Authorization": "Bearer sk-alice-0001"}) as resp:
        assert resp.headers["x-hicache-worker"] == home
        parts = [json.loads(line) for line in resp.iter_lines() if line.strip()]
    assert len(parts) > 1 and parts[-1]["done"] and not any(p["done"] for p in parts[:-1])
    assert "".join(p["message"]["content"] for p in parts) == a1.content[0].text
    assert parts[-1]["prompt_eval_count"] < 16  # computed: less than a page; the rest came from the cache
    oc = ollama.Client(host=r.url, headers={"Authorization": "Bearer sk-alice-0001"})
    g = oc.generate(model="tiny", prompt=msgs[0]["content"], system=system, stream=False,
                    options={"temperature": 0, "num_predict": 4})
    assert g.response == a1.content[0].text and g.prompt_eval_count < 16
    assert [m.model for m in oc.list().models] == ["tiny"] and oc.show("tiny").modelinfo
