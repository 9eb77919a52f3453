"""Checks of the tutorial programs (harness/lang_programs.py) that hold on any backend with a
radix cache (the server through RuntimeEndpoint, the in-process Engine): cached tokens, shapes
and constraints always; with ``smart`` (SmolLM2, not a tiny random model) the answers too."""

from __future__ import annotations

import json
import re

from harness import lang_programs as p

PAGE = 4  # the tests' servers and engines run with --page-size 4


def full_pages(n: int) -> int:
    return n // PAGE * PAGE


def check_basic_qa(backend, smart: bool) -> None:
    state = p.basic_qa.run(question="What is the capital of France?", backend=backend, temperature=0)
    assert "Paris" in state["answer"] or not smart
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert msgs[1]["content"] == "What is the capital of France?" and msgs[2]["content"] == state["answer"]
    assert state.text().endswith(state["answer"] + "<|im_end|>\n")
    # the second run of the same program finds its whole prompt cached and answers the same
    again = p.basic_qa.run(question="What is the capital of France?", backend=backend, temperature=0)
    meta = again.get_meta_info("answer")
    assert again["answer"] == state["answer"]
    assert meta["cached_tokens"] >= full_pages(meta["prompt_tokens"] - 1)


def check_multi_turn(backend, smart: bool) -> None:
    state = p.multi_turn_qa.run(backend=backend, temperature=0)
    first, second = state.get_meta_info("first_answer"), state.get_meta_info("second_answer")
    assert (state["first_answer"] and state["second_answer"]) or not smart
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]
    # the second turn's prompt starts with the first turn's prompt and answer: cached
    assert second["cached_tokens"] >= full_pages(first["prompt_tokens"])
    assert state.stream_executor.session_id is not None  # a program of several calls ran in a session


def check_select(backend, smart: bool) -> None:
    state = p.capital.run(country="France", backend=backend)
    assert state["city"] == "Paris" or not smart
    meta = state.get_meta_info("city")
    assert meta["choices_method"] == "token_length_normalized"
    best = meta["choices"].index(state["city"])
    assert meta["scores"][best] == max(meta["scores"])
    assert meta["scores"] == [sum(lp) / len(lp) for lp in meta["input_token_logprobs"]]
    assert all(lps and all(x <= 0 for x in lps) for lps in meta["input_token_logprobs"])
    assert state.text().endswith(" is " + state["city"])
    tool = p.tool_use.run(question="What is 12 times 34", backend=backend, temperature=0)
    assert tool["tool"] in ("calculator", "search engine")
    assert ("expression" in tool) == (tool["tool"] == "calculator")
    assert p.capital.run(country="Germany", backend=backend)["city"] == "Berlin" or not smart


def check_fork(backend, smart: bool) -> None:
    state = p.tip_suggestion.run(backend=backend, temperature=0)
    tips = state["detailed_tip"]
    assert isinstance(tips, list) and len(tips) == 4 and all(isinstance(t, str) for t in tips)
    assert all(tips) or not smart
    metas = state.get_meta_info("detailed_tip")
    prefix_tokens = metas[0]["prompt_tokens"] - 12  # "Now, expand tip i into a paragraph:\n" is < 12 tokens
    for m in metas:  # every branch found the shared prefix (sent once before them) in the cache
        assert m["cached_tokens"] >= full_pages(prefix_tokens), metas
    assert state.text().startswith("Here are four tips")
    assert "Tip 1:" + tips[0] + "\n" + "Tip 2:" + tips[1] + "\n" in state.text()
    assert state["summary"] or not smart


def check_regex_and_json(backend, smart: bool) -> None:
    ip = p.regular_expression_gen.run(backend=backend)["answer"]
    assert re.fullmatch(p.IP_REGEX, ip), ip
    out = json.loads(p.character_gen.run(name="Hermione Granger", backend=backend, temperature=0)["json_output"])
    assert set(out) == {"name", "house", "age"}
    assert out["house"] in ("Gryffindor", "Slytherin", "Ravenclaw", "Hufflepuff") and 10 <= out["age"] <= 99


def check_run_batch(backend, capsys, smart: bool) -> None:
    states = p.text_qa.run_batch([{"question": c} for c in p.COUNTRIES], backend=backend, progress_bar=True,
                                 temperature=0)
    assert len(states) == 16
    answers = [s["answer"] for s in states]
    assert all(isinstance(a, str) for a in answers), answers
    assert ("Berlin" in answers[0] and "Madrid" in answers[1]) or not smart
    few_shot = states[0].get_meta_info("answer")["prompt_tokens"] - 10
    hits = [s.get_meta_info("answer")["cached_tokens"] for s in states[1:]]
    assert all(h >= full_pages(few_shot) for h in hits), hits  # the shared header was computed once
    assert "16/16" in capsys.readouterr().err  # the progress bar


def check_stream(backend, smart: bool) -> None:
    state = p.basic_qa.run(question="Name three colours.", backend=backend, temperature=0, stream=True)
    pieces = list(state.text_iter(var_name="answer"))
    assert len(pieces) > 1 and "".join(pieces) == state["answer"]
    assert list(state.text_iter(var_name="answer")) == pieces  # a reader that comes after the end sees each delta
    full = p.basic_qa.run(question="Name three colours.", backend=backend, temperature=0, stream=True)
    text = "".join(full.text_iter())
    assert text == full.text() and full["answer"] == state["answer"]


class TutorialPrograms:
    """The tutorial programs on the tiny chat model as tests (answers not checked: ``smart=False``), for
    a test module with a ``backend`` fixture: ``class TestTutorial(TutorialPrograms)`` runs them there."""

    def test_basic_qa(self, backend) -> None:
        check_basic_qa(backend, smart=False)

    def test_multi_turn(self, backend) -> None:
        check_multi_turn(backend, smart=False)

    def test_select(self, backend) -> None:
        check_select(backend, smart=False)

    def test_fork_join(self, backend) -> None:
        check_fork(backend, smart=False)

    def test_regex_and_json_schema(self, backend) -> None:
        check_regex_and_json(backend, smart=False)

    def test_run_batch(self, backend, capsys) -> None:
        check_run_batch(backend, capsys, smart=False)

    def test_stream(self, backend) -> None:
        check_stream(backend, smart=False)
