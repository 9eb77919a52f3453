"""Per-request cache_salt in the engine: same salt shares, different salts share nothing in any
tier (L1, L2, L3 keys), outputs stay HF's greedy answers, and the tree stays consistent."""

from __future__ import annotations

import threading

import pytest

from harness.engine_cases import GREEDY, ids_of, prompts
from harness.model_utils import hf_greedy, tiny_model
from hicache import salt
from hicache.keys import page_keys
from serving.engine import Engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("salt"))
    ps = prompts(2, 512, seed=11, lo=40, hi=50)
    return path, ps, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def make(path, db=None, **kw) -> Engine:
    if db is not None:
        kw.update(hicache_storage_backend="lmdb", hicache_storage_prefetch_threshold=4,
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1},
                  hicache_storage_prefetch_policy="wait_complete", hicache_storage_load_policy="always_load")
    kw.setdefault("max_total_tokens", 256)
    return Engine(model_path=str(path), page_size=4, **kw)


def cached(out) -> int:
    return out["meta_info"]["cached_tokens"]


def test_salt_functions():
    a, b = salt.salt_tags("alice"), salt.salt_tags("bob")
    assert a != b and len(a) == salt.SALTED_TOKENS and salt.salt_tags(None) == ()
    toks = [0, 5, 2**31, 7, 9]
    sa = salt.apply(toks, a)
    assert sa[4:] == toks[4:] and all(t < -(2**32) for t in sa[:4]) and all(t >= -(2**63) for t in sa)
    assert salt.strip(sa) == toks and salt.salt_of(sa) == a and salt.salt_of(toks) is None
    assert salt.apply(toks, b)[:4] != sa[:4]
    # the L3 keys of a salted sequence share nothing with the unsalted or another salt's keys
    ka, kb, k0 = (page_keys(t, 2, "ns") for t in (sa, salt.apply(toks, b), toks))
    assert not set(ka) & set(kb) and not set(ka) & set(k0)
    # a tenant cannot reach another tenant's space through its own cache_salt
    assert salt.combine("alice", None) != salt.combine(None, "alice")
    assert salt.combine("a", "b|c") != salt.combine("a|b", "c") and salt.combine(None, None) is None


def test_same_salt_shares_other_salt_shares_nothing(tiny):
    path, ps, ref = tiny
    eng = make(path, hicache_ratio=2.0)
    try:
        p = ps[0]
        first = eng.generate(input_ids=p, sampling_params=GREEDY, cache_salt="alice")
        assert ids_of([first]) == ref[:1] and cached(first) == 0
        again = eng.generate(input_ids=p, sampling_params=GREEDY, cache_salt="alice")
        assert ids_of([again]) == ref[:1] and cached(again) > 0
        other = eng.generate(input_ids=p, sampling_params=GREEDY, cache_salt="bob")
        assert ids_of([other]) == ref[:1] and cached(other) == 0
        plain = eng.generate(input_ids=p, sampling_params=GREEDY)
        assert ids_of([plain]) == ref[:1] and cached(plain) == 0
        assert cached(eng.generate(input_ids=p, sampling_params=GREEDY)) > 0
        # every tree node under the root belongs to exactly one salt (or none)
        tops = [salt.salt_of(c.key) for c in eng.core.tree.root.children.values()]
        assert sorted(map(str, tops)) == sorted(map(str, [salt.salt_tags("alice"), salt.salt_tags("bob"), None]))
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_l2_hit_respects_salt(tiny):
    """Pages evicted from L1 to L2 come back only for the same salt."""
    path, ps, ref = tiny
    eng = make(path, hicache_ratio=4.0, max_total_tokens=96)
    try:
        eng.generate(input_ids=ps[0], sampling_params=GREEDY, cache_salt="alice")
        eng.generate(input_ids=ps[1], sampling_params=GREEDY, cache_salt="carol")  # pushes alice's pages to L2
        eng.core.tree.evict_device(10**6)
        eng.core.req_cache.flush_transfers()
        bob = eng.generate(input_ids=ps[0], sampling_params=GREEDY, cache_salt="bob")
        assert cached(bob) == 0 and ids_of([bob]) == ref[:1]
        alice = eng.generate(input_ids=ps[0], sampling_params=GREEDY, cache_salt="alice")
        assert alice["meta_info"]["cached_tokens_details"]["host"] > 0 and ids_of([alice]) == ref[:1]
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_l3_keys_differ_and_restart_shares_only_within_salt(tiny, tmp_path):
    path, ps, ref = tiny
    db = tmp_path / "l3"
    eng = make(path, db)
    try:
        for s in ("alice", "bob"):
            eng.generate(input_ids=ps[0], sampling_params=GREEDY, cache_salt=s)
    finally:
        eng.shutdown()  # persists every cached page on to L3
    eng = make(path, db, max_running_requests=1)
    try:
        ns = eng.core.storage.writeback.namespace
        tier = eng.core.storage.tier
        ka = page_keys(salt.apply(ps[0], salt.salt_tags("alice")), 4, ns)
        kb = page_keys(salt.apply(ps[0], salt.salt_tags("bob")), 4, ns)
        k0 = page_keys(ps[0], 4, ns)
        assert not set(ka) & set(kb)
        assert tier.batch_exists(ka) == len(ka) and tier.batch_exists(kb) == len(kb)
        assert tier.batch_exists(k0) == 0  # nothing unsalted was ever written
        carol = eng.generate(input_ids=ps[0], sampling_params=GREEDY, cache_salt="carol")
        assert cached(carol) == 0 and ids_of([carol]) == ref[:1]
        alice = eng.generate(input_ids=ps[0], sampling_params=GREEDY, cache_salt="alice")
        assert alice["meta_info"]["cached_tokens_details"]["storage"] > 0 and ids_of([alice]) == ref[:1]
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_bad_salt_is_invalid(tiny):
    path, ps, _ = tiny
    eng = make(path)
    try:
        for bad in ("", "x" * (salt.MAX_SALT_CHARS + 1)):
            with pytest.raises(Exception, match="cache_salt"):
                eng.generate(input_ids=ps[0], sampling_params=GREEDY, cache_salt=bad)
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_l3_quota_caps_a_tenants_writes(tiny, tmp_path):
    """A tenant at its L3 quota gets no more pages written, counting the writes still in flight
    (the writer is held until every write is submitted); another tenant is not affected."""
    path, ps, _ = tiny
    eng = make(path, tmp_path / "l3")
    eng.core.set_quotas({"alice": {"storage": 3}})
    release = threading.Event()
    eng.core.storage.writeback.before_write = lambda: release.wait(60)
    try:
        for tenant, p in (("alice", ps[0]), ("alice", ps[1]), ("bob", ps[0])):
            for _ in range(2):  # the second hits the first: backed up to L2, then written to L3
                req = eng.core.make_request(input_ids=p, sampling_params=GREEDY, cache_salt=tenant, tenant=tenant)
                eng.core.add(req)
                while not req.finished:
                    eng.core.step()
        eng.check_integrity()  # with the writes held in flight: queue, pending nodes and reservations agree
        assert eng.core.ledger.storage_reserved.get("alice") == 3, eng.core.ledger.storage_reserved
        release.set()
        eng.core.storage.poll(wait=True)
        led = eng.core.ledger
        assert 0 < led.pages("alice", "storage") <= 3, led.snapshot()
        assert led.pages("bob", "storage") > 3
        assert eng.core.storage.writeback.pages_over_quota > 0
        assert not led.storage_reserved, led.storage_reserved  # every reservation settled
        eng.check_integrity()
    finally:
        release.set()
        eng.shutdown()
