"""The language's Anthropic backend against this project's own /v1/messages (a real server with
an API key, the ``anthropic`` SDK): chat programs give the same greedy answers as
RuntimeEndpoint, plain and streamed, with the server's cache counts; what the Messages API
cannot do (constrained decoding, select) is a clear error naming the call."""

from __future__ import annotations

import pytest

import serving.lang as sgl
from harness import lang_programs as p
from harness.lang_programs import API_KEY

KEY = API_KEY


def claude(server, native, key: str = KEY) -> sgl.Anthropic:
    return sgl.Anthropic(native.model_info["served_model_name"], base_url=server.url, api_key=key)


def test_chat_programs_match_native(server, native) -> None:
    q = {"question": "What is the capital of France?"}
    ref = p.basic_qa.run(**q, backend=native, temperature=0)
    state = p.basic_qa.run(**q, backend=claude(server, native), temperature=0)
    assert state["answer"] == ref["answer"]  # the server's template over system + messages == the program's text
    meta = state.get_meta_info("answer")
    assert meta["cached_tokens"] > 0 and meta["prompt_tokens"] > meta["cached_tokens"] // 2  # the native run's KV
    multi = p.multi_turn_qa.run(backend=claude(server, native), temperature=0)
    ref = p.multi_turn_qa.run(backend=native, temperature=0)
    assert (multi["first_answer"], multi["second_answer"]) == (ref["first_answer"], ref["second_answer"])
    assert multi.get_meta_info("second_answer")["cached_tokens"] >= multi.get_meta_info("first_answer")[
        "prompt_tokens"] // 4 * 4


def test_stream(server, native) -> None:
    state = p.basic_qa.run(question="Name three colours.", backend=claude(server, native), temperature=0,
                           stream=True)
    pieces = list(state.text_iter(var_name="answer"))
    assert len(pieces) > 1 and "".join(pieces) == state["answer"]
    assert state["answer"] == p.basic_qa.run(question="Name three colours.", backend=native,
                                             temperature=0)["answer"]
    assert state.get_meta_info("answer")["completion_tokens"] > 0


@sgl.function
def constrained(s):
    s += sgl.user("Pick a digit.")
    s += sgl.assistant(sgl.gen("d", regex="[0-9]", max_tokens=2))


@sgl.function
def choose(s):
    s += sgl.user("Yes or no?")
    s += sgl.assistant(sgl.select("a", choices=["yes", "no"]))


def test_what_the_messages_api_cannot_do_is_a_clear_error(server, native) -> None:
    be = claude(server, native)
    with pytest.raises(sgl.LangError, match=r"gen\('d'\) in program 'constrained': .*does not pass 'regex'"):
        constrained.run(backend=be)
    with pytest.raises(sgl.LangError, match=r"select\('a'\) in program 'choose': Anthropic cannot score"):
        choose.run(backend=be)
    with pytest.raises(sgl.LangError, match=r"gen\('answer'\) in program 'text_qa': .*start of an assistant turn"):
        p.text_qa.run(question="Chile", backend=be)
    with pytest.raises(sgl.LangError, match="the server answered 401"):
        p.basic_qa.run(question="hi", backend=claude(server, native, key="wrong"))
