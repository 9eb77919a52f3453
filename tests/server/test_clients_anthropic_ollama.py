"""The Anthropic and Ollama Python clients against a real server (/v1/messages, /api/*):
content, usage and cached tokens, streaming, each API's own error shape."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import ollama
import pytest

from harness.server_utils import running_server

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 6
KEY = "sk-test-key"
GREEDY = {"temperature": 0}  # current Anthropic SDKs have no sampling arguments


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path):
    with running_server(["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--page-size", "4",
                         "--max-total-tokens", "8192", "--hicache-ratio", "0"], api_key=KEY) as s:
        yield s


def openai_chat(server, messages, **kw) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=60,
                   json={"model": "tiny", "messages": messages, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_anthropic_messages(server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)  # sends x-api-key
    msgs = [{"role": "user", "content": "Name three colours."}]
    ref = openai_chat(server, [{"role": "system", "content": SYSTEM}, *msgs], max_tokens=8)
    r = client.messages.create(model="tiny", system=SYSTEM, messages=msgs, max_tokens=8, extra_body=GREEDY)
    assert r.content[0].type == "text" and r.content[0].text == ref["choices"][0]["message"]["content"]
    assert r.stop_reason in ("max_tokens", "end_turn") and r.usage.output_tokens == 8
    prompt = ref["usage"]["prompt_tokens"]
    # the same prompt as the OpenAI request before it: served from the cache
    assert r.usage.cache_read_input_tokens >= prompt - 4
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == prompt
    turn2 = [*msgs, {"role": "assistant", "content": r.content[0].text}, {"role": "user", "content": "More?"}]
    events, text = [], ""
    with client.messages.stream(model="tiny", system=SYSTEM, messages=turn2, max_tokens=6, extra_body=GREEDY) as s:
        for ev in s:
            events.append(ev.type)
            if ev.type == "content_block_delta":
                text += ev.delta.text
        final = s.get_final_message()
    assert events[0] == "message_start" and "content_block_delta" in events and events[-1] == "message_stop"
    assert final.content[0].text == text and final.usage.output_tokens == 6
    assert final.usage.cache_read_input_tokens >= prompt - 4  # the first turn's KV
    stopped = client.messages.create(model="tiny", system=SYSTEM, messages=msgs, max_tokens=20, extra_body=GREEDY,
                                     stop_sequences=[r.content[0].text[3:6]])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == r.content[0].text[3:6]
    count = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=msgs)
    assert count.input_tokens == prompt
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", messages=msgs, max_tokens=0)
    assert e.value.body["type"] == "error" and "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", messages=msgs, max_tokens=4)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", messages=msgs, max_tokens=4)


def test_ollama_chat_generate_tags_show(server) -> None:
    client = ollama.Client(host=server.url, headers=server.headers)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}]
    ref = openai_chat(server, msgs, max_tokens=6)
    r = client.chat(model="tiny:latest", messages=msgs, stream=False, options={"temperature": 0, "num_predict": 6,
                                                                                 "num_ctx": 2048})
    assert r.message.role == "assistant" and r.message.content == ref["choices"][0]["message"]["content"]
    assert r.done and r.done_reason == "length" and r.eval_count == 6
    prompt = ref["usage"]["prompt_tokens"]
    assert r.prompt_eval_count <= 4  # computed: the rest came from the cache
    parts = list(client.chat(model="tiny", messages=msgs, stream=True, options={"temperature": 0, "num_predict": 6}))
    assert "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].done and not any(p.done for p in parts[:-1]) and parts[-1].eval_count == 6
    g = client.generate(model="tiny", prompt="Name a fruit.", system=SYSTEM, stream=False,
                        options={"temperature": 0, "num_predict": 6})
    assert g.response == r.message.content and g.prompt_eval_count <= 4
    raw = client.generate(model="tiny", prompt="Once upon a time", raw=True, options={"temperature": 0,
                                                                                       "num_predict": 4})
    plain = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60, json={
        "model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}).json()
    assert raw.response == plain["choices"][0]["text"]
    streamed = "".join(p.response for p in client.generate(model="tiny", prompt="Once upon a time", raw=True,
                                                           stream=True, options={"temperature": 0,
                                                                                 "num_predict": 4}))
    assert streamed == raw.response
    tags = client.list()
    assert [m.model for m in tags.models] == ["tiny"]
    show = client.show("tiny")
    assert "completion" in show.capabilities and show.modelinfo["general.context_length"] == 512
    assert prompt > 4
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=msgs, options={"mirostat": 2})
    assert e.value.status_code == 400 and "mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=msgs)
    assert e.value.status_code == 404
    r = httpx.post(server.url + "/api/chat", headers=server.headers, json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and set(r.json()) == {"error"} and "messages" in r.json()["error"]
    assert server.check_integrity()["running"] == 0


BAD = [
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "content"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "role"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                      "tools": [{"name": "f"}]}, 400, "tools"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                      "temperature": 3}, 400, "temperature"),
    ("/v1/messages", {"model": "tiny", "max_tokens": 10**6, "messages": [{"role": "user", "content": "x"}],
                      "stream": True}, 400, "max_tokens"),
    ("/v1/messages", [1, 2], 400, "object"),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "format": {"type": 5}}, 400,
     "json_schema"),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                   "options": {"temperature": "hot"}}, 400, "temperature"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "images": ["aGk="]}, 400, "images"),
    ("/api/generate", {"model": "tiny", "prompt": "x", "options": {"num_predict": 10**6}}, 400, "num_predict"),
    ("/api/show", {}, 400, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "word"), BAD)
def test_bad_input_has_each_apis_error_shape(server, path: str, body, status: int, word: str) -> None:
    r = httpx.post(server.url + path, headers=server.headers, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()
    if path.startswith("/api/"):
        assert set(err) == {"error"} and word in err["error"]
    else:
        assert err["type"] == "error" and word in err["error"]["message"], err
