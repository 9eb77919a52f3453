"""Grammar budgets (serving/grammar/compile_pool.py): grammar work never blocks the batch. A grammar
that compiles for minutes waits in the queue while other requests run, then fails naming the time
budget; an oversize one is refused at once; aborting its requests cancels a compile; past
``grammar_max_pending_compiles`` a new grammar is refused (429). The memory budget is
tests/engine/test_grammar_limits.py; the grammar layer itself tests/engine/test_grammar.py."""

from __future__ import annotations

import re
import time

import pytest

from serving.structs.sampling_params import InvalidRequest

GREEDY = {"temperature": 0.0}


# -- budgets: grammar work never blocks the batch ---------------------------------------------
# ``(a|b)*`` repeated: 6 KB of regex that xgrammar compiles in minutes (the time grows
# quadratically with the repeats: 200 -> ~5 s, 400 -> ~20 s). Each test uses its own count, so
# that the compiled-grammar cache (which keeps timed-out grammars) does not answer for it.
def _pathological(repeats: int = 1000) -> str:
    return "(a|b)*" * repeats


BUDGET_S = 4.0  # generous: the other requests must finish well within it on a loaded machine
MAX_BYTES = 8192


@pytest.fixture(scope="module")
def budget_engine(lang_model):
    """One compile worker, a 4 s compile budget, an 8 KiB size budget, at most 4 pending compiles."""
    from serving.engine import Engine

    eng = Engine(model_path=str(lang_model), max_total_tokens=4096, max_running_requests=16,
                 grammar_compile_timeout_s=BUDGET_S, grammar_max_bytes=MAX_BYTES, grammar_compile_workers=1,
                 grammar_max_pending_compiles=4)
    yield eng
    eng.shutdown()


def _steps_until(core, cond, timeout: float = 120.0) -> list:
    """Drive the scheduler until ``cond()``; the requests finished meanwhile, in order."""
    finished, deadline = [], time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        before = core.scheduler.stats.forward_passes
        finished += [r for r in core.step() if r.finished]
        if core.scheduler.stats.forward_passes == before:
            time.sleep(0.002)
    return finished


def _compiles(core) -> dict:
    return core.grammar.compiles.stats()


def test_pathological_grammar_never_blocks_the_batch(budget_engine) -> None:
    """A grammar that compiles for minutes waits in the queue while the other requests run to
    the end (plain ones, and a constrained one whose grammar is compiled already); it then
    fails with a 400 naming the time budget, and the next grammar compiles normally."""
    core = budget_engine.core
    digits = {**GREEDY, "max_new_tokens": 8, "regex": "[0-9]{3}"}
    budget_engine.generate("warm", digits)  # compiled and cached; the worker is up
    bad = core.make_request(text="Hi", sampling_params={"max_new_tokens": 2, "regex": _pathological(1000)})
    core.add(bad)
    _steps_until(core, lambda: _compiles(core)["in_trial"] == 1)  # compiling in the worker now
    normal = [core.make_request(text=f"Tell me about {w}.", sampling_params={**GREEDY, "max_new_tokens": 12})
              for w in ("cats", "dogs", "the sea")]
    normal.append(core.make_request(text="A number:", sampling_params=digits))
    for r in normal:
        core.add(r)
    done = _steps_until(core, lambda: all(r.finished for r in normal))
    assert bad not in done and not bad.finished and bad.output_ids == [] and bad in core.scheduler.waiting
    assert _compiles(core)["in_trial"] == 1  # still compiling while the others ran to the end
    for r in normal[:3]:
        assert r.finish_reason == {"type": "length", "length": 12}, r.finish_reason
    assert re.fullmatch("[0-9]{3}", core.tokenizer.decode(normal[3].output_ids))
    _steps_until(core, lambda: bad.finished)
    reason = bad.finish_reason
    assert reason["type"] == "abort" and reason["status"] == 400, reason
    assert "grammar_compile_timeout_s" in reason["message"] and f"{BUDGET_S:g} s" in reason["message"], reason
    assert bad.output_ids == [] and _compiles(core)["timeouts"] == 1
    # the same grammar again fails at once (no second trial); a new grammar compiles (worker restarted)
    trials = _compiles(core)["trials"]
    again = budget_engine.generate("Hi", {"max_new_tokens": 2, "regex": _pathological(1000)})
    assert "grammar_compile_timeout_s" in again["meta_info"]["finish_reason"]["message"]
    assert _compiles(core)["trials"] == trials
    out = budget_engine.generate("Code:", {**GREEDY, "max_new_tokens": 8, "regex": "[A-Z]{2}"})
    assert re.fullmatch("[A-Z]{2}", out["text"]), out
    assert not core.scheduler.waiting and not core.scheduler.running
    budget_engine.check_integrity()


def test_oversize_grammar_is_refused_at_once(budget_engine) -> None:
    core = budget_engine.core
    trials = _compiles(core)["trials"]
    for params in [{"regex": "a" * (MAX_BYTES + 1)},
                   {"regex": "\u00e9" * (MAX_BYTES // 2 + 1)},  # bytes (UTF-8), not characters
                   {"json_schema": {"enum": ["x" * MAX_BYTES]}},
                   {"ebnf": 'root ::= "' + "a" * MAX_BYTES + '"'}]:
        with pytest.raises(InvalidRequest, match=f"over the limit of {MAX_BYTES} bytes \\(grammar_max_bytes\\)"):
            core.make_request(text="x", sampling_params=params)
    assert _compiles(core)["trials"] == trials and not core.scheduler.waiting
    ok = budget_engine.generate("x", {**GREEDY, "max_new_tokens": 4, "regex": "[0-9]{2}" + "x?" * 100})
    assert ok["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_abort_while_compiling_cancels_the_compile(budget_engine) -> None:
    """Requests that share a compile: aborting one leaves it running; aborting the last kills
    the worker's trial, frees its slot (the next grammar compiles), and leaks nothing."""
    core = budget_engine.core
    before = _compiles(core)
    text = _pathological(1100)
    reqs = [core.make_request(text=f"Hi {i}", sampling_params={"max_new_tokens": 2, "regex": text}) for i in range(2)]
    for r in reqs:
        core.add(r)
    _steps_until(core, lambda: _compiles(core)["in_trial"] == 1)
    core.scheduler.abort(reqs[0].rid)
    _steps_until(core, lambda: reqs[0].finished)
    time.sleep(0.1)
    assert _compiles(core)["in_trial"] == 1 and ("regex", text) in core.grammar.cache  # the other one waits
    core.scheduler.abort(reqs[1].rid)
    assert all(r.finish_reason == {"type": "abort", "message": "aborted"} for r in reqs)
    assert ("regex", text) not in core.grammar.cache
    _steps_until(core, lambda: _compiles(core)["in_trial"] == 0, timeout=10)
    after = _compiles(core)
    assert after["cancelled"] == before["cancelled"] + 1 and after["timeouts"] == before["timeouts"]
    assert after["queued"] == after["compiling"] == 0
    assert not core.scheduler.waiting and not core.scheduler.running and core.scheduler.in_use_pages() == 0
    budget_engine.check_integrity()
    # the slot is free: a new grammar compiles on the restarted worker, well within the budget
    out = budget_engine.generate("Code:", {**GREEDY, "max_new_tokens": 8, "regex": "[a-c]{3}"})
    assert re.fullmatch("[a-c]{3}", out["text"]), out
    assert _compiles(core)["worker_starts"] > before["worker_starts"]
    budget_engine.check_integrity()


def test_too_many_pending_compiles_is_refused(budget_engine) -> None:
    """Past grammar_max_pending_compiles distinct grammars waiting, a new one is refused (429)
    instead of queueing behind them; aborting the waiting ones empties the queue."""
    core = budget_engine.core
    reqs = []
    for i in range(4):
        r = core.make_request(text="Hi", sampling_params={"max_new_tokens": 2, "regex": _pathological(700 + i)})
        core.add(r)
        reqs.append(r)
    with pytest.raises(OverflowError, match="grammar_max_pending_compiles"):
        core.make_request(text="Hi", sampling_params={"max_new_tokens": 2, "regex": "[0-9]"})
    _steps_until(core, lambda: _compiles(core)["in_trial"] == 1)
    for r in reqs:
        core.scheduler.abort(r.rid)
    _steps_until(core, lambda: sum(_compiles(core)[k] for k in ("queued", "in_trial", "compiling")) == 0,
                 timeout=10)
    assert not core.scheduler.waiting
    out = budget_engine.generate("x", {**GREEDY, "max_new_tokens": 4, "regex": "[0-9]"})
    assert out["text"].isdigit(), out
    budget_engine.check_integrity()
