"""A worker killed (SIGKILL) while the router relays its streams (issue 25, finding 5): every
client gets its API's error event and terminator, never a stream that merely stops.

One real worker (a tiny model with a long context: the streams are thousands of tokens from
their end when it dies) behind a real router; four streams open through it with four real
clients (the OpenAI SDK, httpx on SGLang's /generate, the Anthropic SDK, the Ollama client);
after each has its first chunks, the worker and its engine are killed. The SDKs raise; the raw
stream ends with an OpenAI-shaped error event and ``data: [DONE]``; the router marks the worker
unhealthy at once (its own health checks are a minute apart here). Also the relay's framing:
an event cut in half by the break is dropped, not glued to the error event.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from harness.server_utils import ServerProcess, kill_tree
from router.config import RouterConfig
from router.embedded import RouterThread
from router.errors import OLLAMA, OPENAI, Shape
from router.relay import StreamRelay

LONG = 12000  # tokens each stream asks for: far more than it gets before the kill
MSGS = [{"role": "user", "content": "Tell me a very long story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness.model_utils import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny-long"), with_tokenizer=True, max_position_embeddings=16384)


@pytest.mark.slow
def test_worker_killed_mid_stream_every_client_sees_an_error(long_model: Path) -> None:
    worker = ServerProcess(["--model-path", str(long_model), "--served-model-name", "tiny",
                            "--max-total-tokens", "65536"])
    worker.start()
    try:
        cfg = RouterConfig(worker_urls=(worker.url,), health_check_interval_s=60.0, tokenizer_workers=0)
        with RouterThread(cfg) as r, ExitStack() as stack:
            greedy = {"temperature": 0}
            oa = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0)
            s_openai = oa.chat.completions.create(model="tiny", messages=MSGS, max_tokens=LONG, stream=True,
                                                  extra_body={"ignore_eos": True, **greedy})
            stack.callback(s_openai.close)
            assert next(s_openai).choices[0].delta.role == "assistant"
            assert next(s_openai).choices[0].delta.content is not None

            body = {"text": "Once upon a time", "stream": True,
                    "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, **greedy}}
            raw = stack.enter_context(httpx.stream("POST", r.url + "/generate", json=body, timeout=60))
            assert raw.status_code == 200
            lines = raw.iter_lines()
            head = [next(lines) for _ in range(4)]  # two events: "data: ...", ""
            assert head[0].startswith("data: {") and head[2].startswith("data: {")

            an = anthropic.Anthropic(base_url=r.url, api_key="none", max_retries=0)
            s_anthropic = an.messages.create(model="tiny", messages=MSGS, max_tokens=LONG, stream=True,
                                             extra_body=greedy)
            stack.callback(s_anthropic.close)
            assert next(s_anthropic).type == "message_start"

            s_ollama = ollama.Client(host=r.url).chat(model="tiny", messages=MSGS, stream=True,
                                                      options={"num_predict": LONG, **greedy})
            first = next(s_ollama)
            assert first.done is False

            kill_tree(worker.proc)  # a crash, not a shutdown

            with pytest.raises(openai.APIError) as e_openai:
                for chunk in s_openai:
                    assert chunk.choices[0].finish_reason is None  # it never "finishes"
            assert "incomplete" in e_openai.value.message and e_openai.value.body["code"] == "502"

            rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]", rest[-3:]
            err = json.loads(rest[-2].removeprefix("data: "))["error"]
            assert err["code"] == "502" and err["type"] == "internal_server_error" and worker.url in err["message"]
            assert all("error" not in json.loads(x[6:]) for x in rest[:-2])  # whole events, then the error

            with pytest.raises(anthropic.APIError) as e_anthropic:
                for ev in s_anthropic:
                    assert ev.type != "message_stop"
            assert e_anthropic.value.body["type"] == "error"
            assert e_anthropic.value.body["error"]["type"] == "api_error"

            with pytest.raises(ollama.ResponseError) as e_ollama:
                for part in s_ollama:
                    assert part.done is False
            assert "incomplete" in str(e_ollama.value)

            def victim() -> dict:
                return httpx.get(r.url + "/list_workers", timeout=10).json()["workers"][0]

            state = _poll(victim, lambda w: not w["healthy"])
            assert not state["healthy"] and state["requests_failed"] >= 4, state
            assert state["in_flight"] == 0, state
    finally:
        if worker.proc is not None and worker.proc.poll() is None:
            kill_tree(worker.proc)  # a crash, not a shutdown


def _poll(get: Callable[[], dict], ok: Callable[[dict], bool], timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        v = get()
        if ok(v) or time.monotonic() > deadline:
            return v
        time.sleep(0.1)


async def _chunks(parts: list[bytes], fail: Exception) -> AsyncIterator[bytes]:
    for p in parts:
        yield p
    raise fail


def _relayed(shape: Shape, parts: list[bytes]) -> tuple[bytes, bool]:
    async def run() -> tuple[bytes, bool]:
        relay = StreamRelay(shape, "http://w")
        out = b"".join([c async for c in relay.events(_chunks(parts, httpx.RemoteProtocolError("cut short")))])
        return out, relay.broken

    return asyncio.run(run())


def test_relay_drops_a_half_event_before_the_error() -> None:
    out, broken = _relayed(OPENAI, [b'data: {"a": 1}\n\ndata: {"b"', b': 2}\n\ndata: {"c": '])
    assert broken
    events = out.decode().split("\n\n")
    assert events[:2] == ['data: {"a": 1}', 'data: {"b": 2}'] and events[3:] == ["data: [DONE]", ""]
    assert json.loads(events[2][6:])["error"]["code"] == "502"
    out, _ = _relayed(OLLAMA, [b'{"x": 1}\n{"y"'])
    assert [json.loads(line) for line in out.decode().splitlines()][0] == {"x": 1}
    assert "cut short" in json.loads(out.decode().splitlines()[1])["error"]
