"""The grammar layer (serving/grammar): specs, the compiled-grammar cache, the xgrammar backend,
and the engine with a tiny random model (``lang_model``: SmolLM2's tokenizer and EOS): masks,
termination, mixed batches, jump-forward equal to step-by-step decoding. The budgets (time, size,
pending compiles) are tests/engine/test_grammar_budget.py."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from serving.grammar.lru import CompiledGrammarCache
from serving.structs.grammar_spec import grammar_spec, normalize_grammar_params, response_format_params
from serving.structs.sampling_params import InvalidRequest, SamplingParams

GREEDY = {"temperature": 0.0}
ANSWER_EBNF = 'root ::= "Answer: " ("yes" | "no") "."'
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "color": {"enum": ["red", "green"]},
    },
    "required": ["ok", "n", "color"],
}


# -- specs ------------------------------------------------------------------------------------
def test_response_format_mapping() -> None:
    assert response_format_params(None) == {}
    assert response_format_params({"type": "text"}) == {}
    assert json.loads(response_format_params({"type": "json_object"})["json_schema"]) == {"type": "object"}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert json.loads(response_format_params(rf)["json_schema"]) == SCHEMA
    for bad, words in [
        ({"type": "xml"}, "type must be"),
        ({"type": "json_schema"}, "needs a"),
        ({"type": "json_schema", "json_schema": {"schema": 3}}, "schema must be"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "bogus": 1}}, "bogus"),
        ({"type": "text", "extra": 1}, "extra"),
    ]:
        with pytest.raises(ValueError, match=words):
            response_format_params(bad)


def test_sampling_params_grammar_keys() -> None:
    p = SamplingParams.from_dict({"json_schema": SCHEMA})
    assert json.loads(p.json_schema) == SCHEMA and grammar_spec(p) == ("json_schema", p.json_schema)
    assert grammar_spec(SamplingParams.from_dict({"regex": "a+"})) == ("regex", "a+")
    assert grammar_spec(SamplingParams()) is None
    for bad in ({"regex": "a", "ebnf": "b"}, {"regex": ""}, {"ebnf": 3}, {"json_schema": [1]}):
        with pytest.raises(InvalidRequest):
            SamplingParams.from_dict(bad)
    d = {"json_schema": {"type": "string"}}
    assert normalize_grammar_params(d) is None and d["json_schema"] == '{"type": "string"}'


# -- compiled-grammar cache -------------------------------------------------------------------
def _done(value: object) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def test_lru_hits_eviction_and_failures() -> None:
    from serving.grammar.compile_job import GrammarTimeout

    cache = CompiledGrammarCache(capacity=2)
    a = cache.get_or_start(("regex", "a"), lambda: _done("A"))
    assert cache.get_or_start(("regex", "a"), lambda: _done("other")) is a  # hit: not started again
    cache.get_or_start(("regex", "b"), lambda: _done("B"))
    cache.get_or_start(("regex", "a"), lambda: _done("X"))  # touch a: b is now the oldest
    cache.get_or_start(("regex", "c"), lambda: _done("C"))
    assert ("regex", "b") not in cache and ("regex", "a") in cache and len(cache) == 2
    assert cache.stats() == {"size": 2, "hits": 2, "misses": 3}
    with pytest.raises(ValueError):  # a parse error: nothing cached
        cache.get_or_start(("regex", "bad"), lambda: (_ for _ in ()).throw(ValueError("bad")))
    failed: Future = Future()
    cache.get_or_start(("regex", "f"), lambda: failed)
    failed.set_exception(RuntimeError("compile failed"))
    assert ("regex", "f") not in cache  # retried next time
    timed_out: Future = Future()
    cache.get_or_start(("regex", "t"), lambda: timed_out)
    timed_out.set_exception(GrammarTimeout("over the budget"))
    assert ("regex", "t") in cache  # sent again, it fails at once
    cache.discard(("regex", "t"), timed_out)
    assert ("regex", "t") not in cache


# -- xgrammar backend -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend(lang_model):
    from serving.grammar.xgrammar_backend import XGrammarBackend
    from serving.tokenizer import Tokenizer

    return XGrammarBackend(Tokenizer(str(lang_model)).hf_full(), 49152, [2])


@pytest.mark.parametrize("kind,text,words", [
    ("regex", "[a-", "Unclosed"),
    ("ebnf", 'root ::= "a" missing', 'Rule "missing" is not defined'),
    ("ebnf", 'start ::= "a"', "root rule"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", '{"type": "foo"}', 'Unsupported type "foo"'),
])
def test_backend_errors_name_the_problem(backend, kind: str, text: str, words: str) -> None:
    from serving.grammar.base import GrammarError

    with pytest.raises(GrammarError) as e:
        backend.parse(kind, text)
    msg = str(e.value)
    assert msg.startswith(f"invalid {kind}") and words in msg, msg
    assert ".cc:" not in msg and "Check failed" not in msg, msg


def test_backend_forced_tokens_and_masks(backend) -> None:
    from serving.grammar.bitmask import single_set_bit

    m = backend.new_matcher(backend.compile(backend.parse("ebnf", 'root ::= "ab" ("c" | "d")')))
    for ch in "ab":  # the forced "ab" may be split several ways: no single token yet
        assert m.accept_string(ch)
    assert backend.forced_token(m) is None  # "c" or "d"
    mask = backend.allocate_mask(3)
    backend.fill_masks([m], mask, [1])
    logits = torch.zeros(3, 49152)
    backend.apply_masks(logits, mask, [1])
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()  # other rows untouched
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert len(allowed) == 2
    assert m.accept_token(allowed[0])
    assert backend.forced_token(m) == 2  # complete: only the stop token is left
    row = torch.zeros(4, dtype=torch.int32)
    row[2] = 1 << 5
    assert single_set_bit(row, 128) == 69 and single_set_bit(row, 60) is None
    row[0] = 1
    assert single_set_bit(row, 128) is None


# -- engine, tiny random model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(lang_model):
    from serving.engine import Engine

    eng = Engine(model_path=str(lang_model), max_total_tokens=4096, max_running_requests=16)
    yield eng
    eng.shutdown()


def _run(engine, prompts, params, jump: bool = True):
    engine.core.grammar.enable_jump_forward = jump
    before = engine.core.scheduler.stats.forward_passes
    outs = engine.generate(prompts, params)
    return outs, engine.core.scheduler.stats.forward_passes - before


def test_engine_outputs_match(engine) -> None:
    # the module's first engine test: the backend was not built at start, the first grammar builds it
    assert not engine.core.grammar.backend.built
    prompts = ["Reply in JSON.", "Pick one.", "Code:", "Reply in JSON again."]
    params = [
        {**GREEDY, "max_new_tokens": 60, "json_schema": SCHEMA},
        {**GREEDY, "max_new_tokens": 20, "ebnf": ANSWER_EBNF},
        {**GREEDY, "max_new_tokens": 20, "regex": r"[A-Z]{2}-[0-9]{3}"},
        {"temperature": 1.0, "seed": 7, "max_new_tokens": 60, "json_schema": SCHEMA},
    ]
    outs, _ = _run(engine, prompts, params)
    for o in outs:
        assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}, o
    jsonschema.validate(json.loads(outs[0]["text"]), SCHEMA)
    assert re.fullmatch(r"Answer: (yes|no)\.", outs[1]["text"]), outs[1]["text"]
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", outs[2]["text"]), outs[2]["text"]
    jsonschema.validate(json.loads(outs[3]["text"]), SCHEMA)
    assert engine.core.grammar.backend.built


@pytest.mark.parametrize("min_jump", [1, None])  # every forced run / the default (runs that end the grammar)
def test_jump_forward_equals_step_by_step(engine, min_jump) -> None:
    prompts = ["Reply in JSON.", "Pick one.", "Digits:", "Plain text, no grammar."]
    params = [
        {**GREEDY, "max_new_tokens": 60, "json_schema": SCHEMA},
        {**GREEDY, "max_new_tokens": 20, "ebnf": ANSWER_EBNF},
        {**GREEDY, "max_new_tokens": 20, "regex": r"(abc|abd)xyz!"},
        {**GREEDY, "max_new_tokens": 12},
    ]
    g = engine.core.grammar
    default = g.min_jump_tokens
    g.min_jump_tokens = min_jump or default
    try:
        jumped = g.stats.jumped_tokens
        on, passes_on = _run(engine, prompts, params, jump=True)
        assert g.stats.jumped_tokens > jumped
    finally:
        g.min_jump_tokens = default
    off, passes_off = _run(engine, prompts, params, jump=False)
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    assert [o["meta_info"]["finish_reason"] for o in on] == [o["meta_info"]["finish_reason"] for o in off]
    assert passes_on < passes_off, (passes_on, passes_off)
    engine.check_integrity()


def test_mixed_batch_unconstrained_unchanged(engine) -> None:
    plain = {**GREEDY, "max_new_tokens": 16}
    alone = engine.generate("Tell me something.", plain)
    outs = engine.generate(
        ["Reply in JSON.", "Tell me something.", "Pick one."],
        [{**GREEDY, "max_new_tokens": 60, "json_schema": SCHEMA}, plain,
         {**GREEDY, "max_new_tokens": 20, "ebnf": ANSWER_EBNF}])
    assert outs[1]["output_ids"] == alone["output_ids"]
    jsonschema.validate(json.loads(outs[0]["text"]), SCHEMA)


def test_cache_hits_and_termination(engine) -> None:
    g = engine.core.grammar
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
    misses, hits = g.cache.misses, g.cache.hits
    outs = engine.generate(["a", "b", "c"], {**GREEDY, "max_new_tokens": 30, "json_schema": schema})
    assert g.cache.misses == misses + 1 and g.cache.hits == hits + 2
    # the grammar's end finishes the request (reason stop) even with ignore_eos
    o = engine.generate("d", {**GREEDY, "max_new_tokens": 30, "json_schema": schema, "ignore_eos": True})
    assert o["meta_info"]["finish_reason"]["type"] == "stop" and o["text"] == outs[0]["text"]
    # too few tokens: cut off by length, like any request
    o = engine.generate("e", {**GREEDY, "max_new_tokens": 3, "json_schema": schema})
    assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_invalid_grammar_fails_before_any_token(engine) -> None:
    """Parsing runs off the scheduler thread: an invalid grammar ends its request, with a 400
    naming the problem, before it reaches a batch."""
    for params, words in [({"regex": "(unclosed"}, "invalid regex"),
                          ({"json_schema": '{"type": "nope"}'}, "invalid json_schema")]:
        out = engine.generate("x", params)
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and reason["status"] == 400 and words in reason["message"], reason
        assert out["output_ids"] == []
    assert not engine.core.scheduler.waiting and not engine.core.scheduler.running
    assert engine.generate("x", {**GREEDY, "max_new_tokens": 4, "regex": "[0-9]+"})["text"].isdigit()
    engine.check_integrity()


def test_compile_overlaps_and_large_batch(engine) -> None:
    """Many distinct grammars at once (compiles on the worker, masks for a batch > 64 rows)."""
    n = 70
    prompts = [f"item {i}" for i in range(n)]
    params = [{**GREEDY, "max_new_tokens": 8, "regex": f"{i}-[a-c]{{2}}"} for i in range(n)]
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    assert time.perf_counter() - t < 60
    for i, o in enumerate(outs):
        assert re.fullmatch(f"{i}-[a-c]{{2}}", o["text"]), (i, o["text"])
    engine.check_integrity()


def test_backend_none_refuses(lang_model) -> None:
    from serving.engine import Engine

    eng = Engine(model_path=str(lang_model), max_total_tokens=1024, grammar_backend="none")
    try:
        with pytest.raises(InvalidRequest, match="grammar-backend none"):
            eng.generate("x", {"regex": "a"})
        assert eng.generate("x", {**GREEDY, "max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    finally:
        eng.shutdown()
