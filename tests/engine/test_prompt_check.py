"""A prompt's rules have one owner (serving/scheduler/prompt_check.py, issue 28): the engine refuses a
bad prompt with the message the HTTP process gives for it, and checks each request once
(``Scheduler.validate`` ran twice per request before: in ``make_request`` and again in ``add``)."""

from __future__ import annotations

import pytest

from harness.model_utils import tiny_model
from serving.engine import Engine
from serving.scheduler.prompt_check import PromptError, check_budget, check_fits, check_prompt
from serving.scheduler.scheduler import Scheduler
from serving.structs.sampling_params import InvalidRequest

CONTEXT = 64
GREEDY = {"temperature": 0, "max_new_tokens": 2}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(model_path=str(tiny_model(tmp_path_factory.mktemp("prompt-check"))), page_size=4,
                 max_total_tokens=48, context_length=CONTEXT)
    yield eng
    eng.shutdown()


def message(rule, *args) -> str:
    with pytest.raises(PromptError) as e:
        rule(*args)
    return str(e.value)


def test_the_rules() -> None:
    assert message(check_prompt, [], 100, CONTEXT) == "the prompt is empty"
    assert message(check_prompt, [1] * CONTEXT, 100, CONTEXT) == \
        f"the prompt has {CONTEXT} tokens; this model's context length is {CONTEXT}"
    for bad in ([1, 100], [1, -1], [1, True], "1 2", [1.0]):
        with pytest.raises(PromptError, match=r"^prompt: token ids must be in \[0, 100\)$") as e:
            check_prompt(bad, 100, CONTEXT, "prompt")
        assert e.value.param == "prompt"
    check_prompt([0, 99], 100, CONTEXT)
    with pytest.raises(PromptError, match="^max_tokens is too large: the prompt has 60 tokens") as e:
        check_budget(60, 5, CONTEXT)
    assert e.value.param == "max_tokens"
    check_budget(60, 4, CONTEXT)
    assert message(check_fits, 48, 48) == "the prompt has 48 tokens; the KV cache holds 48"
    check_fits(47, 48)


def test_the_engine_gives_the_rules_messages(engine) -> None:
    vocab = engine.core.runner.arch.vocab_size
    for bad in ([], list(range(1, CONTEXT + 5)), [1, 2, 10**6], [1, True]):
        with pytest.raises(InvalidRequest) as e:
            engine.generate(input_ids=bad, sampling_params=GREEDY)
        assert str(e.value) == message(check_prompt, bad, vocab, CONTEXT)
    with pytest.raises(InvalidRequest) as e:  # within the context, over the KV cache's 48 tokens
        engine.generate(input_ids=list(range(1, 50)), sampling_params=GREEDY)
    assert str(e.value) == message(check_fits, 49, 48)
    engine.check_integrity()


def test_a_request_is_validated_once(engine, monkeypatch) -> None:
    calls = []
    validate = Scheduler.validate
    monkeypatch.setattr(Scheduler, "validate", lambda self, req: (calls.append(req.rid), validate(self, req)))
    out = engine.generate(input_ids=[1, 2, 3, 4, 5], sampling_params=GREEDY)
    assert len(out["output_ids"] if isinstance(out, dict) else out[0]["output_ids"]) == 2
    assert len(calls) == 1, calls
