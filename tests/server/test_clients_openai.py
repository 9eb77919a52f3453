"""The OpenAI SDK against a real server: logprobs (chat and completions, echo, streamed),
``n > 1`` (one prefill shared by the choices), usage with cached tokens."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from harness.server_utils import running_server

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 6


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path):
    with running_server(["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--page-size", "4",
                         "--max-total-tokens", "8192", "--hicache-ratio", "0"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def computed_prompt_tokens(server) -> int:
    st = httpx.get(server.url + "/get_server_info", timeout=30).json()["internal_states"][0]
    return st["prompt_tokens"] - st["cached_tokens"]


def test_chat_logprobs_plain_and_streamed(client: OpenAI, server) -> None:
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == choice.message.content
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)  # greedy: the top-1
    assert bytes(b for c in content for b in c.bytes).decode() == choice.message.content  # raw token bytes
    streamed = []
    for chunk in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                                logprobs=True, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    # the streamed request prefills only the uncached suffix: fp32 GEMMs of another shape round
    # differently (~1e-6), so the logprobs agree closely, not to the bit (rounding to 5 places flaked)
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == choice.message.content


def test_completions_echo_logprobs_scoring(client: OpenAI) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == prompt and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    gen = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=2, temperature=0)
    g = gen.choices[0]
    assert g.text.startswith(prompt) and len(g.logprobs.tokens) == len(lp.tokens) + 4
    for a, b in zip(g.logprobs.token_logprobs[1: len(lp.tokens)], lp.token_logprobs[1:], strict=True):
        assert math.isclose(a, b, abs_tol=1e-4)  # the same prompt scores the same, cached or not
    text, lps = "", []
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                                           temperature=0, stream=True):
        text += chunk.choices[0].text
        lps += chunk.choices[0].logprobs.token_logprobs
    assert text == g.text and len(lps) == len(g.logprobs.token_logprobs)


def test_n_choices_share_one_prefill(client: OpenAI, server) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me a story about a cat."}]
    before = computed_prompt_tokens(server)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, n=4, temperature=1.0, seed=7)
    computed = computed_prompt_tokens(server) - before
    prompt = r.usage.prompt_tokens
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 4 * 5
    # the warm-up computed the prompt (plus one token of it per choice at most a page): not 4 prompts
    assert prompt < computed <= prompt + 4 * 4, (prompt, computed)
    assert len({c.message.content for c in r.choices}) > 1  # seeds differ per choice
    again = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, n=4, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    assert again.usage.prompt_tokens_details.cached_tokens >= prompt - 4  # the prompt came from the cache
    greedy = client.completions.create(model="tiny", prompt=["Once upon a time", "In a galaxy"], max_tokens=3, n=2,
                                       temperature=0)
    texts = [c.text for c in greedy.choices]
    assert len(texts) == 4 and texts[0] == texts[1] and texts[2] == texts[3]
    chunks = {}
    for chunk in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, n=3, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        for ch in chunk.choices:
            chunks[ch.index] = chunks.get(ch.index, "") + (ch.delta.content or "")
        if chunk.usage:
            assert chunk.usage.completion_tokens == 15 and chunk.usage.prompt_tokens == prompt
    assert sorted(chunks) == [0, 1, 2] and len(set(chunks.values())) == 1
    assert server.check_integrity()["running"] == 0


def test_openai_fields_at_defaults(client: OpenAI) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    base = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, temperature=0, user="u1",
                                       metadata={"k": "v"}, store=False, service_tier="auto",
                                       parallel_tool_calls=True, n=1)
    assert r.choices[0].message.content == base.choices[0].message.content
    with pytest.raises(Exception) as e:
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, store=True)
    assert "store" in str(e.value) and "400" in str(e.value)


def test_generate_n_and_logprobs_with_a_grammar(server) -> None:
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 3},
            "return_logprob": True}
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 3 and len({tuple(o["output_ids"]) for o in outs}) == 1  # greedy: 3 equal choices
    assert all(len(o["meta_info"]["output_token_logprobs"]) == 4 for o in outs)
    # a grammar forces most tokens (jump-forward): they get logprob 0, one entry per output id
    body = {"text": "Answer:", "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                   "regex": "The answer is (yes|no)\\."},
            "return_logprob": True, "top_logprobs_num": 2}
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    lps = out["meta_info"]["output_token_logprobs"]
    assert out["text"].startswith(("The answer is yes.", "The answer is no."))  # (+ the tiny model's eos text)
    assert [t for _, t, _ in lps] == out["output_ids"] and len(out["meta_info"]["output_top_logprobs"]) == len(lps)
    assert any(lp == 0.0 for lp, _, _ in lps) and all(lp <= 0 for lp, _, _ in lps)


def test_generate_streams_a_batch_with_n(server) -> None:
    import json

    body = {"text": ["Once upon a time", "In a galaxy"], "stream": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "n": 2}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    last = {c["index"]: c for c in chunks}
    assert sorted(last) == [0, 1, 2, 3] and all(len(c["output_ids"]) == 3 for c in last.values())
    plain = httpx.post(server.url + "/generate", timeout=60, json={**body, "stream": False}).json()
    assert [o["text"] for o in plain] == [last[i]["text"] for i in range(4)]
