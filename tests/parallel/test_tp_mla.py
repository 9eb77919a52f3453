"""DeepSeek-V2 (MLA) under tensor parallelism on CPU (gloo, fp32): TP=2 greedy tokens equal TP=1's and
HF's, through L3 (LMDB) and after a restart, and L3 holds one entry per page: the latent is the same on
every rank, its part is stored under rank 0's key (``tp_shard_key``), rank 0 writes it and every rank
reads it. So a TP=1 engine finds a TP=2 engine's pages (the same namespace: the latent's layout does
not depend on the rank count)."""

from __future__ import annotations

import pytest

from harness.engine_cases import generate_checked, hits, ids_of, lmdb_l3, tier_prompts
from harness.model_utils import hf_greedy, tiny_model
from hicache.keys import page_keys, tp_shard_key
from hicache.tiers.lmdb.store import LMDBStore
from serving.engine import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
PS = 4
LMDB = {"capacity_gb": 0.05, "initial_map_mb": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("tp-dsv2"), "deepseek_v2")
    ps, _ = tier_prompts()
    return path, ps, hf_greedy(path, ps, GREEDY["max_new_tokens"])


def l3_engine(path, db, **kw) -> Engine:
    return Engine(model_path=str(path), page_size=PS, max_total_tokens=256, hicache_ratio=2.0, **lmdb_l3(db), **kw)


def entries(db) -> int:
    store = LMDBStore.from_config({"path": str(db), **LMDB})
    try:
        return int(store.stats()["entries"])
    finally:
        store.close()


def sent_to_rank1(eng: Engine) -> list[str]:
    """The kinds of the L3 requests rank 0 sends rank 1 from now on (recorded as they go)."""
    sent: list[str] = []
    rpc = eng.core.tp._rpcs[0]
    call = rpc.call

    def recording(req):  # noqa: ANN001, ANN202
        sent.append(type(req).__name__)
        return call(req)

    rpc.call = recording
    return sent


def persist(path, db, ps, ref, **kw) -> tuple[str, list[str]]:
    """Two rounds (the second hits the first's pages, written on to L3), then a persisting shutdown;
    integrity checked after every step (every rank's pools). The namespace, the requests sent to rank 1."""
    eng = l3_engine(path, db, **kw)
    sent = sent_to_rank1(eng) if kw.get("tp_size") else []
    try:
        for _ in range(2):
            assert ids_of(generate_checked(eng, ps, GREEDY)) == ref
        return eng.core.storage.writeback.namespace, sent
    finally:
        eng.shutdown()


def test_tp2_equals_tp1_with_one_l3_entry_per_page(tiny, tmp_path) -> None:
    path, ps, ref = tiny
    ns1, _ = persist(path, tmp_path / "tp1", ps, ref)
    ns2, sent = persist(path, tmp_path / "tp2", ps, ref, tp_size=2)
    assert ns1 == ns2  # the latent's layout is the same at any TP size
    assert "L3Set" not in sent, sent  # rank 0 wrote every page alone
    n1 = entries(tmp_path / "tp1")
    n2 = entries(tmp_path / "tp2")
    pages = {k for p, r in zip(ps, ref, strict=True) for k in page_keys(p + r, PS, ns2)}  # prompt + output
    assert n2 == n1 and 0 < n2 <= len(pages), (n1, n2, len(pages))  # not one per rank
    assert all(tp_shard_key(k, 0, 1) == k for k in pages)  # rank 1's part: rank 0's key

    eng = l3_engine(path, tmp_path / "tp2", tp_size=2, max_running_requests=1)  # a restart: L1, L2 empty
    sent = sent_to_rank1(eng)
    try:
        outs = generate_checked(eng, ps, GREEDY)
        assert ids_of(outs) == ref
        assert all(h > 0 for h in hits(outs, "storage")), hits(outs, "storage")
        assert "L3Get" in sent  # every rank reads the page (into its own L2)
    finally:
        eng.shutdown()
    eng = l3_engine(path, tmp_path / "tp2", max_running_requests=1)  # TP=1 reads TP=2's pages
    try:
        outs = generate_checked(eng, ps, GREEDY)
        assert ids_of(outs) == ref
        assert all(h > 0 for h in hits(outs, "storage")), hits(outs, "storage")
    finally:
        eng.shutdown()


def test_tp2_l2_hits_equal_hf(tiny) -> None:
    path, ps, ref = tiny
    _, others = tier_prompts()
    eng = Engine(model_path=str(path), page_size=PS, max_total_tokens=160, hicache_ratio=4.0,
                 write_through_threshold=1, max_running_requests=2, tp_size=2)
    try:
        assert ids_of(generate_checked(eng, ps, GREEDY)) == ref
        generate_checked(eng, others, GREEDY)  # pushes ps out of L1
        again = generate_checked(eng, ps, GREEDY)
        assert ids_of(again) == ref and sum(hits(again, "host")) > 0, [o["meta_info"] for o in again]
    finally:
        eng.shutdown()
