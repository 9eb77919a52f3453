"""Router units (no servers): approximate tree, policies, circuit breaker, config, cache events."""

from __future__ import annotations

import random

import pytest

from hicache.hiradix import HiRadixTree
from hicache.keys import page_keys
from hicache.tiers.allocator import PageAllocator
from router.approx_tree import ApproxTree, text_key, token_key
from router.cache_view import CacheView, WorkerCache
from router.config import ConfigError, RouterConfig, build_config, load_config
from router.policies import POLICIES, RouteRequest, make_policy
from router.workers import CLOSED, HALF_OPEN, OPEN, Worker, WorkerPool
from serving.engine.cache_events import CacheEventLog


# -- approximate tree -----------------------------------------------------------------------
def test_tree_match_insert_split() -> None:
    t = ApproxTree()
    t.insert("hello world", "a")
    t.insert("hello there", "b")
    assert t.match("hello world!") == (11, ["a"])
    assert t.match("hello t") == (7, ["b"])
    depth, tenants = t.match("hello")
    assert depth == 5 and sorted(tenants) == ["a", "b"]
    assert t.match("xyz") == (0, [])
    assert t.match("hello world", eligible={"b"}) == (6, ["b"])
    assert t.sizes == {"a": 11, "b": 11}


def test_tree_evict_lru_and_remove() -> None:
    t = ApproxTree()
    t.insert("aaaa1111", "w")
    t.insert("aaaa2222", "w")
    t.insert("aaaa2222", "v")
    t.insert("aaaa1111", "w")  # 1111 is now the most recent
    assert t.sizes["w"] == 12
    assert t.evict("w", 8) == 4
    assert t.match("aaaa2222", {"w"}) == (4, ["w"])
    assert t.match("aaaa1111", {"w"}) == (8, ["w"])
    assert t.match("aaaa2222", {"v"}) == (8, ["v"])
    t.remove_tenant("w")
    assert "w" not in t.sizes and t.match("aaaa1111") == (4, ["v"])


def test_tree_random_against_brute_force() -> None:
    rng = random.Random(0)
    t = ApproxTree()
    sent: dict[str, list[str]] = {"a": [], "b": [], "c": []}
    for _ in range(300):
        s = "".join(rng.choice("xyz") for _ in range(rng.randint(1, 12)))
        w = rng.choice(list(sent))
        t.insert(s, w)
        sent[w].append(s)
    for _ in range(200):
        q = "".join(rng.choice("xyz") for _ in range(rng.randint(1, 14)))
        best = {w: max((_lcp(q, s) for s in ss), default=0) for w, ss in sent.items()}
        depth, tenants = t.match(q)
        assert depth == max(best.values())
        if depth:
            assert sorted(tenants) == sorted(w for w, d in best.items() if d == depth)
    for w, ss in sent.items():
        assert t.sizes[w] == _distinct_chars(ss)


def _lcp(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _distinct_chars(strings: list[str]) -> int:
    return len({s[:i] for s in strings for i in range(1, len(s) + 1)})


def test_keys() -> None:
    assert token_key([1, 2]) != text_key("\x01\x02")
    with pytest.raises(ValueError):
        token_key([2**21])


# -- policies -------------------------------------------------------------------------------
def _workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://w{i}", polled_load=x) for i, x in enumerate(loads)]


def test_registry_and_simple_policies() -> None:
    assert set(POLICIES) >= {"cache_aware", "round_robin", "random", "power_of_two"}
    ws = _workers(0, 0, 0)
    rr = make_policy(RouterConfig(policy="round_robin"))
    assert [rr.select(RouteRequest(""), ws).url for _ in range(4)] == [w.url for w in ws + ws[:1]]
    p2 = make_policy(RouterConfig(policy="power_of_two"))
    busy = _workers(9, 0)
    assert all(p2.select(RouteRequest(""), busy) is busy[1] for _ in range(10))


def test_cache_aware_prefix_threshold_and_smallest() -> None:
    p = make_policy(RouterConfig(cache_threshold=0.5))
    ws = _workers(0, 0, 0)
    first = p.select(RouteRequest(text_key("system prompt A" * 10 + "q1")), ws)
    p.on_sent(RouteRequest(text_key("system prompt A" * 10 + "q1")), first)
    again = p.select(RouteRequest(text_key("system prompt A" * 10 + "q2")), ws)
    assert again is first
    other = p.select(RouteRequest(text_key("something else entirely")), ws)
    assert other is not first  # below the threshold: the smallest tree


def test_cache_aware_balance_guard() -> None:
    cfg = RouterConfig(balance_abs_threshold=2, balance_rel_threshold=1.5)
    p = make_policy(cfg)
    ws = _workers(0, 0)
    key = RouteRequest(text_key("hot prefix " * 20))
    p.on_sent(key, ws[0])
    ws[0].polled_load = 10
    assert p.select(key, ws) is ws[1]
    ws[0].polled_load = 2
    assert p.select(key, ws) is ws[0]


# -- circuit breaker ------------------------------------------------------------------------
def test_circuit_breaker(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("router.workers.time.monotonic", lambda: now[0])
    pool = WorkerPool(RouterConfig(circuit_failure_threshold=2, circuit_cooldown_s=5), None, {})  # type: ignore[arg-type]
    forgotten: list[str] = []
    pool.on_reset.append(forgotten.append)
    w = pool.add("http://a")
    pool.record(w, False)
    assert w.state == CLOSED
    pool.record(w, False)
    assert w.state == OPEN and forgotten == ["http://a"] and pool.available() == []
    now[0] += 5
    assert pool.available() == [w] and w.state == HALF_OPEN
    pool.begin(w)
    assert pool.available() == []  # one trial at a time
    pool.end(w, ok=False)
    assert w.state == OPEN
    now[0] += 5
    pool.available()
    pool.begin(w)
    pool.end(w, ok=True)
    assert w.state == CLOSED and pool.available() == [w]


# -- config ---------------------------------------------------------------------------------
def test_config_validation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = load_config("configs/router.yaml", {"policy": "round_robin"})
    assert cfg.policy == "round_robin" and len(cfg.worker_urls) == 2
    for bad in ({"policy": "nope"}, {"port": "1"}, {"unknown": 1}, {"worker_urls": ["ftp://x"]}, {"cache_view": "x"}):
        with pytest.raises(ConfigError):
            build_config(bad)
    f = tmp_path / "r.yaml"
    f.write_text("- a list\n")
    with pytest.raises(ConfigError):
        load_config(f)


# -- cache events (tree hook -> event log -> router view) -------------------------------------
def test_tree_listener_hook_and_event_log() -> None:
    ps, ns = 2, "test|ns"
    tree = HiRadixTree(ps, PageAllocator(6), PageAllocator(8), write_policy="write_back")
    kinds: list[str] = []
    tree.add_listener(lambda kind, node: kinds.append(kind))
    log = CacheEventLog(tree, ns, ps)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8]
    tree.insert(a, tree.device.alloc(3))
    tree.insert(b, [0, 0] + tree.device.alloc(1))  # splits a's node; the duplicates are ignored here
    view = WorkerCache()
    CacheView.apply(view, log.read(0, None))  # unknown epoch: a snapshot
    assert set(view.pages) == set(page_keys(a, ps, ns)) | set(page_keys(b, ps, ns))
    assert view.held(page_keys(b, ps, ns)) == (3, 3)
    seq = view.seq
    tree.evict_device(4)  # write_back: demoted to L2
    tree.take_transfers()  # (the tree's contract: drained after each operation, its backups run)
    assert "device_evict" in kinds and "host_add" in kinds
    CacheView.apply(view, log.read(seq, log.epoch))
    assert view.held(page_keys(a, ps, ns)) == (3, 0)  # all on L2 now
    tree.evict_host(8)
    assert "remove" in kinds
    CacheView.apply(view, log.read(view.seq, log.epoch))
    assert view.pages == {}
    tree.insert(a, tree.device.alloc(3))
    tree.reset()
    CacheView.apply(view, log.read(view.seq, log.epoch))
    assert kinds[-1] == "reset" and view.pages == {}
    assert log.read(view.seq, log.epoch)["events"] == []
    log.events.clear()  # lost history: a reader behind gets a snapshot
    assert "snapshot" in log.read(0, log.epoch)


def test_pages_prefetched_from_l3_are_l2_events() -> None:
    ps, ns = 2, "test|ns"
    tree = HiRadixTree(ps, PageAllocator(4), PageAllocator(8))
    log = CacheEventLog(tree, ns, ps)
    tokens = [5, 6, 7, 8]
    tree.insert_host(tokens, tree.host.alloc(2))
    view = WorkerCache()
    CacheView.apply(view, log.read(0, None))
    assert view.held(page_keys(tokens, ps, ns)) == (2, 0)  # held, on L2 only


def test_router_help_describes_every_flag() -> None:
    """``hicache router --help``: every flag has its field's description and default (as ``hicache
    serve --help``), enumerated fields their allowed values."""
    import dataclasses
    import re
    import subprocess
    import sys

    from harness.server_utils import ROOT
    from hicache.config_fields import field_docs

    out = subprocess.run([sys.executable, "-m", "serving.launch.cli", "router", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={"COLUMNS": "200", "PATH": ""})
    assert out.returncode == 0, out.stderr
    docs = field_docs(RouterConfig)
    for f in dataclasses.fields(RouterConfig):
        assert docs.get(f.name), f"RouterConfig.{f.name} has no comment (its --help description)"
        flag = {"prefill_urls": "--prefill", "decode_urls": "--decode"}.get(f.name, "--" + f.name.replace("_", "-"))
        m = re.search(rf"^\s+{re.escape(flag)}[ ,=].*?(?=^\s+--|\Z)", out.stdout, re.M | re.S)
        assert m, f"{flag} not in --help"
        text = " ".join(m.group(0).split())
        if f.name not in ("prefill_urls", "decode_urls"):  # pd_config.py's own help
            assert " ".join(docs[f.name].split()[:3]) in text and "(default: " in text, (flag, text)
    assert "{approx,events}" in out.stdout and "--enable-worker-registration" in out.stdout
