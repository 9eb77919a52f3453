"""litellm and langchain-openai against a real server (OpenAI-compatible routes): invoke and
stream, asserting content, usage and cached tokens."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from harness.server_utils import running_server

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no download at import
SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 6
MSGS = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a river."}]


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path):
    with running_server(["--model-path", str(tiny_chat_model), "--served-model-name", "tiny", "--page-size", "4",
                         "--max-total-tokens", "8192", "--hicache-ratio", "0"]) as s:
        yield s


@pytest.fixture(scope="module")
def reference(server) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": MSGS, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_litellm_completion_and_stream(server, reference) -> None:
    import litellm

    kw = {"model": "openai/tiny", "api_base": server.url + "/v1", "api_key": "none", "messages": MSGS,
          "max_tokens": 6, "temperature": 0}
    r = litellm.completion(**kw)
    want = reference["choices"][0]["message"]["content"]
    assert r.choices[0].message.content == want
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == reference["usage"]["prompt_tokens"]
    assert r.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 4  # the reference's KV
    text, usage = "", None
    for chunk in litellm.completion(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if getattr(chunk, "usage", None):
            usage = chunk.usage
    assert text == want and usage is not None and usage.completion_tokens == 6
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 4


def test_langchain_openai_invoke_and_stream(server, reference) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="tiny", temperature=0, max_tokens=6,
                     stream_usage=True, max_retries=0)
    want = reference["choices"][0]["message"]["content"]
    msgs = [("system", SYSTEM), ("human", "Name a river.")]
    r = llm.invoke(msgs)
    assert r.content == want
    u = r.usage_metadata
    assert u["output_tokens"] == 6 and u["input_tokens"] == reference["usage"]["prompt_tokens"]
    assert u["input_token_details"]["cache_read"] >= u["input_tokens"] - 4
    total = None
    for chunk in llm.stream(msgs):
        total = chunk if total is None else total + chunk
    assert total.content == want
    assert total.usage_metadata["output_tokens"] == 6
    assert total.usage_metadata["input_token_details"]["cache_read"] >= u["input_tokens"] - 4
