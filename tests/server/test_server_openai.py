"""End to end with real clients: the openai SDK and httpx against `hicache serve` (SmolLM2)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import yaml

from harness.model_utils import smollm2_path
from harness.server_utils import ROOT, ServerProcess, running_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
# Long enough to span several 16-token pages, so the second turn reuses them.
SYSTEM = (
    "You are HiCache's assistant. You answer briefly and politely, in plain English, and you never "
    "make up facts. When you do not know something you say so. Keep every answer under twenty words."
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    # configs/l3.yaml with an empty L3 of its own: no page survives from an earlier run, so the
    # cached-token counts below are exact
    cfg = yaml.safe_load((ROOT / "configs" / "l3.yaml").read_text())
    tmp = tmp_path_factory.mktemp("openai-l3")
    cfg["cache"]["hicache_storage_backend_extra_config"]["path"] = str(tmp / "l3")
    (tmp / "l3.yaml").write_text(yaml.safe_dump(cfg))
    args = [
        "--config",
        str(tmp / "l3.yaml"),
        "--model-path",
        str(smollm2_path()),
        "--max-total-tokens",
        "4096",
        "--context-length",
        "2048",
    ]
    with running_server(args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # the first chat prompt this server sees


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=6, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens_details.cached_tokens > 0  # same prompt as the non-streamed call


def test_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=["The capital of France is", "1, 2, 3, 4,"], max_tokens=4, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert "Paris" in r.choices[0].text and "5" in r.choices[1].text
    assert r.usage.completion_tokens == 8
    # 16 prompt tokens in all: each prompt is shorter than one 16-token page, so nothing can match
    assert r.usage.prompt_tokens == 16 and r.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 4
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 3 and ids.usage.completion_tokens == 2


def test_session_second_turn_is_cached(client: openai.OpenAI, server: ServerProcess) -> None:
    sid = httpx.post(server.url + "/open_session", json={}).json()
    assert isinstance(sid, str) and sid
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body={"session_id": sid}
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And a vegetable?"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body={"session_id": sid}
    )
    assert first.usage.prompt_tokens > 2 * 16
    assert second.usage.prompt_tokens_details.cached_tokens >= 2 * 16
    assert httpx.post(server.url + "/close_session", json={"session_id": sid}).status_code == 200
    again = httpx.post(server.url + "/close_session", json={"session_id": sid})
    assert again.status_code == 404 and "session" in again.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="session"):
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body={"session_id": sid}
        )
    named = httpx.post(server.url + "/open_session", json={"session_id": "my-session"}).json()
    assert named == "my-session"
    assert httpx.post(server.url + "/close_session", json={"session_id": named}).status_code == 200


def _sse(lines: list[str]) -> list[dict | str]:
    events: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_native_generate_stream(server: ServerProcess) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    full = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    prev: list[int] = []
    for c in chunks:
        assert c["output_ids"][: len(prev)] == prev and len(c["output_ids"]) > len(prev)  # cumulative
        prev = c["output_ids"]
        meta = c["meta_info"]
        assert meta["completion_tokens"] == len(c["output_ids"]) and meta["prompt_tokens"] == 5
        assert set(meta) >= {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert chunks[-1]["output_ids"] == full["output_ids"] and chunks[-1]["text"] == full["text"]
    assert "Paris" in full["text"]


def test_greedy_matches_offline_engine(server: ServerProcess) -> None:
    from serving.engine import Engine

    prompt = "Write one sentence about the sea:"
    params = {"max_new_tokens": 8, "temperature": 0}
    assert httpx.post(server.url + "/flush_cache").status_code == 200  # cold on both sides
    served = httpx.post(
        server.url + "/generate", json={"text": prompt, "sampling_params": params}, timeout=60
    )
    engine = Engine(model_path=str(smollm2_path()), max_total_tokens=4096, context_length=2048)
    offline = engine.generate(prompt, params)
    engine.shutdown()
    assert served.json()["output_ids"] == offline["output_ids"]
    assert served.json()["text"] == offline["text"]


def test_metrics_and_info(server: ServerProcess) -> None:
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "hicache_prompt_tokens_total",
        "hicache_cached_tokens_total",
        "hicache_generated_tokens_total",
        'hicache_cache_hit_tokens_total{tier="device"}',
        'hicache_pool_pages{pool="device",state="used"}',
        'hicache_pool_pages{pool="device",state="free"}',
        "hicache_storage_used_bytes",
        "hicache_storage_capacity_bytes",
        'hicache_storage_events_total{event="stored"}',
        "hicache_num_running_reqs",
        "hicache_num_waiting_reqs",
        "hicache_time_to_first_token_seconds_count",
        "hicache_inter_token_latency_seconds_bucket",
    ):
        assert name in text, name
    info = httpx.get(server.url + "/get_model_info").json()
    assert info["is_generation"] and info["context_length"] == 2048
    assert httpx.get(server.url + "/health_generate", timeout=60).status_code == 200
    assert httpx.get(server.url + "/get_server_info").json()["server"]["port"] == server.port
    assert server.check_integrity()["ok"]
