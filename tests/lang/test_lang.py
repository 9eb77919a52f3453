"""The frontend language (serving.lang) against a real server through RuntimeEndpoint, on a
tiny random model with SmolLM2's tokenizer and chat template (fast; tests/lang/test_lang_smollm2.py
runs the same programs on SmolLM2 and checks the answers): the tutorial programs' cached tokens
and constraints, a greedy answer equal to a plain /generate of the same text, the prefill-only
request (``max_new_tokens: 0``) that forks rely on, and clear errors naming the program's call."""

from __future__ import annotations

import httpx
import pytest

import serving.lang as sgl
from harness import lang_checks as checks
from harness import lang_programs as p
from harness.lang_programs import LANG_SERVER_ARGS
from harness.server_utils import free_port, running_server

ARGS = LANG_SERVER_ARGS


@pytest.fixture(scope="module")
def server(lang_model):
    with running_server(["--model-path", str(lang_model), *ARGS]) as s:
        yield s
        body = s.check_integrity()
        assert body["running"] == 0 and body["waiting"] == 0


@pytest.fixture(scope="module")
def backend(server):
    be = sgl.RuntimeEndpoint(server.url)
    yield be
    be.shutdown()


def test_template_is_the_models(server, backend) -> None:
    shown = httpx.post(server.url + "/api/show", json={"model": backend.model_info["served_model_name"]}, timeout=30)
    assert shown.status_code == 200 and "<|im_start|>" in shown.json()["template"]  # Ollama's /api/show has it
    tpl = backend.chat_template
    assert tpl.begin("user") == "<|im_start|>user\n" and tpl.end("assistant") == "<|im_end|>\n"
    assert "SmolLM" in tpl.default_system  # SmolLM2's template adds it when there is no system message


class TestTutorial(checks.TutorialPrograms):
    """The tutorial programs through RuntimeEndpoint (harness/lang_checks.py)."""


def test_gen_equals_plain_generate(server, backend) -> None:
    """A program's greedy answer is what /generate gives for the program's text (cold, after a flush)."""
    state = p.basic_qa.run(question="Why is the sky blue?", backend=backend, temperature=0)
    prompt = state.text()[: -len(state["answer"] + "<|im_end|>\n")]
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    r = httpx.post(server.url + "/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 24, "temperature": 0}}, timeout=120).json()
    assert r["meta_info"]["cached_tokens"] == 0 and r["text"] == state["answer"]


def test_prefill_only_request_caches_the_prompt(server) -> None:
    """``max_new_tokens: 0`` on /generate runs a prefill (as SGLang's does): the prompt is cached."""
    text = "A prefill-only request puts this sentence into the radix tree before its branches. " * 3
    first = httpx.post(server.url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 0}},
                       timeout=60).json()
    assert first["text"] == "" and first["output_ids"] == [] and first["meta_info"]["completion_tokens"] == 0
    again = httpx.post(server.url + "/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0}}, timeout=60).json()
    assert again["meta_info"]["cached_tokens"] >= checks.full_pages(first["meta_info"]["prompt_tokens"] - 1)


def test_select_methods_and_int(backend) -> None:
    @sgl.function
    def pick(s):
        s += "The opposite of hot is " + sgl.select("w", ["cold", "warm", "blue"],
                                                    choices_method="unconditional_likelihood_normalized")
        s += ". Two plus two is " + sgl.gen("n", dtype=int, max_tokens=3, temperature=0)

    state = pick.run(backend=backend)
    meta = state.get_meta_info("w")
    assert state["w"] in ("cold", "warm", "blue") and meta["choices_method"] == "unconditional_likelihood_normalized"
    assert all(len(u) == len(c) for u, c in zip(meta["unconditional_token_logprobs"], meta["input_token_logprobs"],
                                                 strict=True))
    assert isinstance(state["n"], int)


def test_bad_regex_names_the_call(backend) -> None:
    @sgl.function
    def bad(s):
        s += "Q: a number?\nA: " + sgl.gen("num", regex="([0-9", max_tokens=4)

    with pytest.raises(sgl.LangError, match=r"gen\('num'\) in program 'bad': the server answered 400") as e:
        bad.run(backend=backend)
    assert e.value.status == 400 and e.value.call == "gen('num')"


def test_reading_a_failed_variable_raises(backend) -> None:
    @sgl.function
    def bad(s):
        s += "x" + sgl.gen("a", max_tokens=2, regex="(")
        s += "y" + sgl.gen("b", max_tokens=2)

    state = p.text_qa.run_batch([{"question": "Chile"}], backend=backend, temperature=0)[0]
    assert state.error() is None
    with pytest.raises(sgl.LangError, match=r"gen\('a'\)"):
        bad.run(backend=backend)


def test_server_down_names_the_call(server) -> None:
    be = sgl.RuntimeEndpoint(server.url)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the server went away
    be.client.base_url = be.base_url = dead
    with pytest.raises(sgl.LangError, match=r"gen\('answer'\) in program 'basic_qa': cannot reach the server"):
        p.basic_qa.run(question="hi", backend=be)
    with pytest.raises(sgl.LangError, match=r"fork\(4\) in program 'tip_suggestion': cannot reach the server"):
        p.tip_suggestion.run(backend=be)
    with pytest.raises(sgl.BackendError, match="cannot reach the server"):
        sgl.RuntimeEndpoint(dead)


def test_default_backend_and_direct_call(backend) -> None:
    sgl.set_default_backend(backend)
    try:
        state = p.basic_qa("What is the capital of Italy?", temperature=0)  # calling the function runs it
        assert state["answer"] == p.basic_qa.run(question="What is the capital of Italy?", backend=backend,
                                                 temperature=0)["answer"]
    finally:
        sgl.set_default_backend(None)


@pytest.mark.parametrize("kw, field", [({"max_tokens": -1}, "max_new_tokens"), ({"temperature": -1.0}, "temperature"),
                                       ({"top_p": 0.0}, "top_p"), ({"json_schema": "{not json"}, "")])
def test_bad_gen_arguments_are_400s(server, backend, kw, field) -> None:
    @sgl.function
    def bad(s):
        s += "Hello" + sgl.gen("x", **kw)

    with pytest.raises(sgl.LangError, match=rf"gen\('x'\) in program 'bad': the server answered 400: .*{field}") as e:
        bad.run(backend=backend)
    assert e.value.status == 400
    server.check_integrity()  # nothing leaked


def test_fork_needs_a_positive_count(backend) -> None:
    @sgl.function
    def bad(s):
        s += "Hello"
        s.fork(0)

    with pytest.raises(ValueError, match="fork"):
        bad.run(backend=backend)


def test_long_program_runs_in_a_session_closed_at_its_end(backend) -> None:
    def open_sessions() -> int:
        return backend.get_server_info()["internal_states"][0]["sessions"]

    seen: list[int] = []

    @sgl.function
    def chat(s):
        s += sgl.user("Hello") + sgl.assistant(sgl.gen("a", max_tokens=4))
        s += sgl.user("Again") + sgl.assistant(sgl.gen("b", max_tokens=4))
        s["b"]  # noqa: B018 - wait for the second call
        seen.append(open_sessions())

    before = open_sessions()
    state = chat.run(backend=backend, temperature=0)
    assert seen == [before + 1] and open_sessions() == before
    assert state.get_meta_info("b")["cached_tokens"] >= checks.full_pages(state.get_meta_info("a")["prompt_tokens"])
