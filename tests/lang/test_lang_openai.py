"""The language's OpenAI backend against this project's own OpenAI-compatible routes (a real
server with an API key, the ``openai`` SDK): chat programs give the same greedy answers as RuntimeEndpoint,
``select`` scores through /v1/completions echo logprobs equal the native API's, and what the
backend cannot do is a clear error naming the call."""

from __future__ import annotations

import pytest

import serving.lang as sgl
from harness import lang_programs as p
from harness.lang_programs import API_KEY

KEY = API_KEY


def oai(native, **kw) -> sgl.OpenAI:
    return sgl.OpenAI(native.model_info["served_model_name"], base_url=native.base_url + "/v1", api_key=KEY, **kw)


def test_api_key(server, native) -> None:
    with pytest.raises(sgl.BackendError, match="the server answered 401"):
        sgl.RuntimeEndpoint(server.url)
    with pytest.raises(sgl.LangError, match=r"gen\('answer'\) in program 'basic_qa': the server answered 401"):
        p.basic_qa.run(question="hi", backend=sgl.OpenAI(native.model_info["served_model_name"],
                                                         base_url=server.url + "/v1", api_key="wrong"))


def test_chat_program_matches_native(native) -> None:
    q = {"question": "What is the capital of France?"}
    ref = p.basic_qa.run(**q, backend=native, temperature=0)
    state = p.basic_qa.run(**q, backend=oai(native), temperature=0)
    assert state["answer"] == ref["answer"]  # the server's template over messages == the program's text
    assert state.get_meta_info("answer")["cached_tokens"] > 0  # the native run's KV
    multi = p.multi_turn_qa.run(backend=oai(native), temperature=0)
    assert multi.get_meta_info("second_answer")["cached_tokens"] >= multi.get_meta_info("first_answer")[
        "prompt_tokens"] // 4 * 4


def test_completion_model_select_matches_native(native) -> None:
    ref = p.capital.run(country="France", backend=native)
    state = p.capital.run(country="France", backend=oai(native, is_chat_model=False))
    assert state["city"] == ref["city"]
    for a, b in zip(state.get_meta_info("city")["scores"], ref.get_meta_info("city")["scores"], strict=True):
        assert abs(a - b) < 1e-4


@sgl.function
def pick_tool(s, question):
    s += sgl.user(question + " Which tool do you need?")
    s += sgl.assistant(sgl.select("tool", choices=["calculator", "search engine"]))


def test_chat_select_needs_the_template(native, lang_model) -> None:
    with pytest.raises(sgl.LangError, match=r"select\('tool'\) in program 'pick_tool': .*chat_template"):
        pick_tool.run(question="What is 3 + 4?", backend=oai(native))
    ref = pick_tool.run(question="What is 3 + 4?", backend=native)
    state = pick_tool.run(question="What is 3 + 4?", backend=oai(native, chat_template=str(lang_model)))
    assert state["tool"] == ref["tool"]
    for a, b in zip(state.get_meta_info("tool")["scores"], ref.get_meta_info("tool")["scores"], strict=True):
        assert abs(a - b) < 1e-4


def test_chat_gen_must_open_an_assistant_turn(native) -> None:
    with pytest.raises(sgl.LangError, match=r"gen\('answer'\) in program 'text_qa': a chat model generates only"):
        p.text_qa.run(question="Chile", backend=oai(native))
    state = p.text_qa.run(question="Chile", backend=oai(native, is_chat_model=False), temperature=0)
    assert state["answer"] == p.text_qa.run(question="Chile", backend=native, temperature=0)["answer"]


def test_stream(native) -> None:
    state = p.basic_qa.run(question="Name three colours.", backend=oai(native), temperature=0, stream=True)
    pieces = list(state.text_iter(var_name="answer"))
    assert len(pieces) > 1 and "".join(pieces) == state["answer"]
    assert state["answer"] == p.basic_qa.run(question="Name three colours.", backend=native,
                                             temperature=0)["answer"]
