"""State snapshots on L3 (issue 43): a tiny random Qwen3.5 (Gated DeltaNet) and Nemotron-H (Mamba2), float32
on CPU, page size 4, LMDB.

A finished request leaves state snapshots on its nodes (the end of its full pages, where the next turn
resumes; before its prompt's last token); with L3 they are written on with the KV (under
``keys.state_key`` of the page before them, hicache/tiers/storage_state.py), so a restarted engine
serves a returning conversation's second turn from L3: the pages up to the deepest stored snapshot and
the snapshot come back into L2, then L1. Every case compares with HF transformers' greedy tokens and
their log-probabilities; a damaged snapshot value is a miss (the shallower one, or a recompute), never a
wrong state."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from harness.engine_cases import hits, ids_of, lmdb_l3
from harness.lmdb_pages import open_store
from harness.model_utils import hf_output_logprobs, tiny_model
from harness.netns import run_mooncake_script
from harness.state_cases import GREEDY, LOGPROB_TOL, NEW, STATE_FAMILIES, generate, two_turns
from hicache.keys import page_keys, state_key
from serving.engine import Engine

pytestmark = pytest.mark.slow
PS = 4


@pytest.fixture(scope="module", params=sorted(STATE_FAMILIES))
def tiny(request, tmp_path_factory):
    """The model; 3 first turns (30-50 tokens), their second turns (first turn + answer + 5-12 tokens),
    and HF's greedy answers to both."""
    path = tiny_model(tmp_path_factory.mktemp(request.param), request.param, **STATE_FAMILIES[request.param])
    return (path, *two_turns(path, 3, seed=15))


def _l3(path, db, **kw) -> Engine:
    return Engine(model_path=str(path), page_size=PS, max_total_tokens=1024, hicache_ratio=2.0, **lmdb_l3(db), **kw)


def _first_turns(path, db, first, ref1) -> str:
    """Serve the first turns, shut down (persisting to L3); the namespace of their keys."""
    eng = _l3(path, db)
    try:
        for p, r in zip(first, ref1, strict=True):
            assert ids_of(eng.generate(input_ids=[p], sampling_params=GREEDY)) == [r]
            eng.check_integrity()
        ns = eng.core.kv_namespace
    finally:
        eng.shutdown()  # persists every page and snapshot to L3
    return ns


def _resume_at(p: list[int]) -> int:
    """Where a second turn resumes: the end of its first turn's full pages (the answer's last token is not in KV)."""
    return (len(p) + NEW - 1) // PS * PS


def test_second_turns_come_from_l3_after_a_restart(tiny, tmp_path) -> None:
    path, first, ref1, second, ref2 = tiny
    db = tmp_path / "l3"
    _first_turns(path, db, first, ref1)
    eng = _l3(path, db)  # a restart: L1 and L2 empty, LMDB holds the pages and the snapshots
    try:
        outs = generate(eng, path, second, ref2, one_at_a_time=True)
        assert hits(outs, "storage") == [_resume_at(p) for p in first], [o["meta_info"] for o in outs]
        st = eng.core.storage.stats()
        assert st["state_snapshots_fetched"] == len(first) and st["state_corrupt"] == 0, st
    finally:
        eng.shutdown()


def test_the_pages_are_fetched_while_the_snapshot_is_read(tiny, tmp_path) -> None:
    """A returning turn's L3 lookup answers from the snapshots' existence: its pages are read while the
    snapshot itself (tens of MB at real shapes) is still being read and verified, and the request runs
    once both are in. The store's snapshot reads are held at a gate (the real LMDB store's method, wrapped):
    pages land meanwhile, then the gate opens and the answer is exact, from L3."""
    path, first, ref1, second, ref2 = tiny
    db = tmp_path / "l3"
    _first_turns(path, db, first[:1], ref1[:1])
    eng = _l3(path, db)
    gate, reading = threading.Event(), threading.Event()
    try:
        backend = eng.core.storage.prefetcher.states[1].backend
        read = backend.get_array

        def held(key):  # noqa: ANN001, ANN202
            reading.set()
            assert gate.wait(30)
            return read(key)

        backend.get_array = held
        out: list = []
        worker = threading.Thread(target=lambda: out.append(generate(eng, path, second[:1], ref2[:1])))
        worker.start()
        try:
            assert reading.wait(30), "the snapshot was never read"
            deadline = time.monotonic() + 10
            while eng.core.storage.tier.stats()["hits"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            landed = eng.core.storage.tier.stats()["hits"]
        finally:
            gate.set()
            worker.join(60)
        assert landed > 0, "no page was fetched before the snapshot's read returned"
        assert out and hits(out[0], "storage") == [_resume_at(first[0])], out
        eng.check_integrity()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("damage", ["overwritten", "truncated"])
def test_a_damaged_snapshot_on_l3_is_a_miss(tiny, tmp_path, damage) -> None:
    """The snapshot at the end of each first turn is damaged in the store: the second turn resumes at the
    one above it (before the first prompt's last token, intact) or recomputes, and its output is exact."""
    path, first, ref1, second, ref2 = tiny
    db = tmp_path / "l3"
    ns = _first_turns(path, db, first, ref1)
    store = open_store(db, capacity_gb=0.05, initial_map_mb=1)
    try:
        for p, a in zip(first, ref1, strict=True):
            end = _resume_at(p)
            key = state_key(page_keys((p + a)[:end], PS, ns)[-1])
            value = store.get(key)
            assert value is not None, "the snapshot was not persisted"
            bad = bytearray(value)
            if damage == "overwritten":
                bad[len(bad) // 3] ^= 0x40  # one flipped bit in the payload
            else:
                bad = bad[: len(bad) // 2]
            store.delete(key)
            assert store.set(key, bytes(bad))
    finally:
        store.close()
    eng = _l3(path, db)
    try:
        outs = generate(eng, path, second, ref2, one_at_a_time=True)
        got = hits(outs, "storage")
        want = [(len(p) - 1) // PS * PS for p in first]  # the intact prompt capture of each first turn
        assert got == want, (got, want)
        assert eng.core.storage.stats()["state_corrupt"] == len(first)
    finally:
        eng.shutdown()


def test_a_second_server_resumes_through_mooncake(tiny, tmp_path) -> None:
    """Server A serves the conversations (its second turns' hits write pages and snapshots on to Mooncake);
    server B, fresh, on the same master, serves the second turns from there: storage hits at the end of
    each first turn, HF's tokens and log-probabilities."""
    path, first, ref1, second, ref2 = tiny
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps({"first": first, "second": second, "new": NEW}))
    res = run_mooncake_script(Path(__file__).parent / "mooncake_state_two_servers.py", str(path), str(tmp_path),
                              str(cases))
    assert res["a_first"] == ref1 and [o["ids"] for o in res["a_second"]] == ref2, res
    assert res["a_snapshots_stored"] and res["a_integrity"], res
    b = res["b_second"]
    assert [o["ids"] for o in b] == ref2, res
    assert [o["storage"] for o in b] == [_resume_at(p) for p in first], res
    assert res["b_stats"]["state_snapshots_fetched"] == len(first), res
    want = hf_output_logprobs(path, second, ref2)
    worst = max(abs(x - y) for o, w in zip(b, want, strict=True) for x, y in zip(o["logprobs"], w, strict=True))
    assert worst < LOGPROB_TOL, worst
    assert res["b_integrity"] and res["exit_codes"] == [0, 0], res
