"""Speculative decoding (NGRAM) is exact: greedy outputs with it on are token-identical to plain
decoding, over batches of many prompts, chunked prefill, preemption, L2 and L3 tiers, stop ids and
lengths that land inside accepted drafts, penalties, logprobs, sessions, cache salts, structured
output (drafts filtered by the grammar) and the overlap scheduler; ``check_integrity()`` holds after
every step and no request keeps a page past its next position (rejected drafts' pages are freed
at once). The tiny random models draft from their own loops and, on a second run, from the tree
(the first run's outputs); SmolLM2 drafts from the file it repeats (a code edit)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from harness.model_utils import smollm2_path, tiny_model
from serving.engine import Engine
from serving.scheduler.overlap import OverlapScheduler
from serving.speculative.cost import StepCost

PS = 4
G = {"temperature": 0, "ignore_eos": True}


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = [[rng.randrange(1, 511) for _ in range(rng.randint(4, 60))] for _ in range(8)]
    return out + [[1, 2, 3, 4, 5, 6, 7] * 8, [9, 8, 7] * 20, [rng.randrange(1, 511) for _ in range(30)] * 3]


def params(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{**G, "max_new_tokens": rng.choice([1, 2, 5, 17, 40, 64])} for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("spec"))


def engine(path, spec: bool, **kw) -> Engine:
    kw = {"page_size": PS, "max_total_tokens": 4096, **kw}
    eng = Engine(model_path=str(path), **kw, **({"speculative_algorithm": "NGRAM"} if spec else {}))
    if spec:  # every draft the policy allows, whatever drafts cost on this machine
        eng.core.speculative.cost = StepCost(0.01, adaptive=False)
    return eng


def drive(eng: Engine, ps: list[list[int]], sps: list[dict], session_id: str | None = None,
          cache_salt: str | None = None):
    """Run to completion checking the engine after every step; the finished requests."""
    core = eng.core
    reqs = [core.make_request(input_ids=p, sampling_params=sp, session_id=session_id,
                              cache_salt=cache_salt) for p, sp in zip(ps, sps, strict=True)]
    for r in reqs:
        core.add(r)
    ps_ = core.req_cache.page_size
    while not all(r.finished for r in reqs):
        core.step()
        core.check_integrity()
        for r in core.scheduler.running:
            if r.kv.kv_len == r.seq_len - 1:  # decoding: nothing past the next position (no rejected draft's page)
                assert len(r.kv.pages) <= max(r.kv.tree_pages, -(-(r.kv.kv_len + 1) // ps_)), r
    return reqs


def ids(reqs) -> list[list[int]]:
    return [list(r.output_ids) for r in reqs]


def accepted(reqs) -> int:
    return sum(r.spec.accepted for r in reqs if r.spec is not None)


def drafted(reqs) -> int:
    return sum(r.spec.drafted for r in reqs if r.spec is not None)


@pytest.fixture(scope="module")
def reference(tiny):
    ps, sps = prompts(), params(11)
    eng = engine(tiny, False)
    return ps, sps, ids(drive(eng, ps, sps))


@pytest.mark.parametrize("kw", [
    {},
    {"chunked_prefill_size": 7},
    {"max_total_tokens": 200, "max_running_requests": 5},  # retractions, drafts only in free pages
    {"max_total_tokens": 200, "hicache_ratio": 4.0},  # L2 backups and load-backs
    {"page_size": 1},
], ids=["plain", "chunked", "retract", "l2", "page1"])
def test_greedy_outputs_are_identical(tiny, reference, kw):
    ps, sps, ref = reference
    if kw.get("page_size") == 1:
        ref = ids(drive(engine(tiny, False, **kw), ps, sps))
    eng = engine(tiny, True, **kw)
    first = drive(eng, ps, sps)
    assert ids(first) == ref
    again = drive(eng, ps, sps)  # the first run's outputs are in the tree now: drafted from there
    assert ids(again) == ref
    if "max_total_tokens" in kw:  # a pool this small: drafts only in free slots, the tree evicted
        assert kw.get("hicache_ratio") or eng.core.scheduler.stats.retractions > 0
    else:
        assert accepted(again) > accepted(first) and drafted(first) > 0  # the periodic prompts draft (and miss)
        long = [r for r in again if r.sampling.max_new_tokens >= 40]
        assert all(r.spec.meta()["spec_accept_length"] > 2 for r in long)
    st = eng.core.speculative.stats_dict()
    assert st["verify_steps"] > 0 and st["accepted_tokens"] <= st["draft_tokens"]


def test_l3_tier(tiny, reference, tmp_path):
    ps, sps, ref = reference
    eng = engine(tiny, True, max_total_tokens=256, hicache_ratio=2.0, hicache_storage_backend="lmdb",
                 hicache_storage_backend_extra_config={"path": str(tmp_path / "l3"), "capacity_gb": 0.05,
                                                       "initial_map_mb": 1})
    try:
        assert ids(drive(eng, ps, sps)) == ref
        eng.core.storage.poll(wait=True)
        assert ids(drive(eng, ps, sps)) == ref
        assert eng.core.storage.stats()["stored"] > 0
    finally:
        eng.shutdown()


def test_stops_inside_accepted_drafts(tiny, reference):
    """A stop id or a length limit that falls inside a run of accepted drafts ends the output on
    exactly the token plain decoding ends on; what followed it is dropped."""
    ps, sps, ref = reference
    eng = engine(tiny, True)
    plain = engine(tiny, False)
    drive(eng, ps, sps)  # the tree now holds every output: the next runs accept long drafts
    rng = random.Random(3)
    stops = []
    for out in ref:
        sp = {**G, "max_new_tokens": rng.randint(1, 64)}
        if len(out) > 6 and rng.random() < 0.6:
            sp["stop_token_ids"] = [out[rng.randrange(2, len(out))]]
        stops.append(sp)
    got, want = drive(eng, ps, stops), drive(plain, ps, stops)
    assert ids(got) == ids(want)
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert accepted(got) > 0


def test_penalties_logprobs_and_salts(tiny, reference):
    ps, sps, _ = reference
    pen = [{**sp, "repetition_penalty": 1.3, "frequency_penalty": 0.2} for sp in sps]
    eng, plain = engine(tiny, True), engine(tiny, False)
    want = drive(plain, ps, pen)
    drive(eng, ps, pen)
    assert ids(drive(eng, ps, pen)) == ids(want)
    # output logprobs of accepted drafts come from their own rows
    a = eng.generate(input_ids=ps[:4], sampling_params=sps[:4], return_logprob=True, top_logprobs_num=2)
    b = plain.generate(input_ids=ps[:4], sampling_params=sps[:4], return_logprob=True, top_logprobs_num=2)
    for x, y in zip(a, b, strict=True):
        assert x["output_ids"] == y["output_ids"]
        lx, ly = x["meta_info"]["output_token_logprobs"], y["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lx] == [t for _, t, _ in ly]
        assert all(abs(p - q) < 1e-4 for (p, _, _), (q, _, _) in zip(lx, ly, strict=True))
        assert len(x["meta_info"]["output_top_logprobs"]) == len(x["output_ids"])
    # a salted request drafts only from its own partition of the tree
    salted = drive(eng, ps, sps, cache_salt="a")
    other = drive(eng, ps, sps, cache_salt="b")
    same = drive(eng, ps, sps, cache_salt="a")
    assert ids(salted) == ids(other) == ids(same) == ids(drive(plain, ps, sps))
    assert accepted(same) > accepted(other)


def test_sessions_many_turns(tiny):
    outs = {}
    for spec in (False, True):
        rng = random.Random(5)
        eng = engine(tiny, spec, max_total_tokens=400)
        sid = eng.open_session("s")
        history, got = [rng.randrange(1, 511) for _ in range(20)], []
        rng2 = random.Random(6)
        for _turn in range(6):
            for _ in range(2):  # each turn is answered, then regenerated (drafted from the first answer)
                r, = drive(eng, [history], [{**G, "max_new_tokens": 24}], session_id=sid)
                got.append(list(r.output_ids))
            history = history + list(r.output_ids) + [rng2.randrange(1, 511) for _ in range(5)]
        outs[spec] = got
        if spec:
            assert eng.core.speculative.stats.accepted_tokens > 0
            assert eng.core.speculative._sessions["s"]  # the next turn starts from this acceptance
    assert outs[True] == outs[False]


def test_overlap_scheduler_with_speculation(tiny, reference):
    """Overlap forced on (a CPU runs it synchronously, same logic): steps that may draft resolve the
    pending tokens first; outputs are unchanged."""
    ps, sps, ref = reference
    eng = engine(tiny, True)
    sched = eng.core.scheduler
    sched._overlap = OverlapScheduler(sched)
    eng.core.speculative.policy.miss_limit = 2  # requests that find no match turn drafting off: their steps overlap
    assert ids(drive(eng, ps, sps)) == ref
    assert ids(drive(eng, ps, sps)) == ref
    assert sched._overlap.overlapped_steps > 0 and eng.core.speculative.stats.accepted_tokens > 0
    assert not any(r.pending >= 0 for r in sched.running)


def test_structured_output_drafts_follow_the_grammar(tiny_chat_model):
    """Drafts the grammar rejects are cut before verification, and each verified position is
    masked by the grammar in its own state: outputs equal plain constrained decoding."""
    eng, plain = engine(tiny_chat_model, True), engine(tiny_chat_model, False)
    tok = eng.core.tokenizer
    regex = r"(red|green|blue)( (red|green|blue)){30}"
    schema = '{"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string", "maxLength": 6}, ' \
             '"minItems": 4, "maxItems": 8}}, "required": ["a"]}'
    ps = [tok.encode(t) for t in ("colors: red green blue red green", "list: red red red", "json please")]
    sps = [{"temperature": 0, "max_new_tokens": 80, "regex": regex},
           {"temperature": 0, "max_new_tokens": 80, "regex": regex},
           {"temperature": 0, "max_new_tokens": 80, "json_schema": schema}]
    for _ in range(2):
        want, got = ids(drive(plain, ps, sps)), drive(eng, ps, sps)
        assert ids(got) == want
    assert accepted(got) > 0
    assert eng.core.grammar.stats.masked_rows > 0
    plain.shutdown()
    eng.shutdown()


def test_smollm2_code_edit_is_exact():
    """SmolLM2 repeating a source file with one change: most drafts are accepted, outputs equal. The files are
    fixed copies (tests/engine/data/): the live sources change, and with them how much SmolLM2 repeats."""
    from transformers import AutoTokenizer

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    ps = []
    data = Path(__file__).parent / "data"
    for name, old, new in (("code_edit_stop.py.txt", "StopChecker", "StopRules"),
                           ("code_edit_schedule_policy.py.txt", "order", "rank")):
        src = (data / name).read_text()
        msg = [{"role": "user", "content": f"Here is a file:\n\n```python\n{src}```\n\nRename {old} to {new}. "
                                           "Reply with the complete updated file."}]
        text = tok.apply_chat_template(msg, add_generation_prompt=True, tokenize=False) + "```python\n"
        ps.append(tok(text)["input_ids"])
    sps = [{"temperature": 0, "max_new_tokens": 48}] * 2
    plain = Engine(model_path=str(path), max_total_tokens=4096)
    want = ids(drive(plain, ps, sps))
    plain.shutdown()
    eng = Engine(model_path=str(path), max_total_tokens=4096, speculative_algorithm="NGRAM")
    eng.core.speculative.cost = StepCost(0.01, adaptive=False)
    got = drive(eng, ps, sps)
    assert ids(got) == want
    for r in got:
        meta = r.spec.meta()
        assert meta["spec_accept_rate"] > 0.5 and meta["spec_accept_length"] > 2, meta
    eng.shutdown()
