"""Prompt normalisation has two owners (issue 28): the worker renders a chat body with its request
models (``template_messages()`` of each API face in serving/server/), the router rebuilds the
messages from the raw body (router/routing_key.py) to key it on the same token ids. They cannot
share code (the router never imports serving); this test holds them to the same ids, body by
body, and names the bodies where they still differ (strict xfails: fixing one fails its xfail,
then move it to AGREE)."""

from __future__ import annotations

from typing import Any

import pytest

from router.routing_key import KeyMaker, load_tokenizer
from serving.server.anthropic_api import MessagesRequest
from serving.server.ollama_api import ChatRequest, GenerateRequest
from serving.server.protocol import ChatCompletionRequest
from serving.tokenizer import Tokenizer

SYSTEM_USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
TURNS = [*SYSTEM_USER, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And now?"}]
TOOL = {"name": "get_time", "description": "The time", "input_schema": {"type": "object", "properties": {}}}

AGREE: dict[str, tuple[str, dict[str, Any]]] = {
    "openai-chat": ("/v1/chat/completions", {"model": "m", "messages": TURNS}),
    "anthropic": ("/v1/messages", {"model": "m", "max_tokens": 4, "system": "Be brief.",
                                   "messages": [{"role": "user", "content": "Hi there"}]}),
    "anthropic-blocks": ("/v1/messages", {"model": "m", "max_tokens": 4,
                                          "system": [{"type": "text", "text": "Be brief."}],
                                          "messages": [{"role": "user", "content": [
                                              {"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]}),
    "ollama-chat": ("/api/chat", {"model": "m", "messages": TURNS}),
    "ollama-generate": ("/api/generate", {"model": "m", "prompt": "Hi there", "system": "Be brief."}),
    "ollama-generate-raw": ("/api/generate", {"model": "m", "prompt": "Hi there", "raw": True}),
    "completions": ("/v1/completions", {"model": "m", "prompt": "Hi there"}),
    "generate": ("/generate", {"text": "Hi there"}),
}
DIFFER: dict[str, tuple[str, dict[str, Any], str]] = {
    "openai-developer": ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        "the worker maps developer to system; the router passes the role as it is"),
    "openai-content-parts": ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]},
        "the worker joins the parts' text; the router hands the list to the chat template"),
    "anthropic-tools": ("/v1/messages", {"model": "m", "max_tokens": 4, "tools": [TOOL],
                                         "messages": [{"role": "user", "content": "What time is it?"}]},
                        "the worker writes the tools before the system text; the router leaves them out"),
}


def worker_ids(tok: Tokenizer, path: str, body: dict[str, Any]) -> list[int]:
    """The ids the worker prefills for ``body`` (ServerContext.chat_ids / encode do the same)."""
    faces = {"/v1/chat/completions": ChatCompletionRequest, "/v1/messages": MessagesRequest,
             "/api/chat": ChatRequest, "/api/generate": GenerateRequest}
    if path in ("/v1/completions", "/generate") or (path == "/api/generate" and body.get("raw")):
        return tok.encode(body.get("prompt", body.get("text")))
    return tok.encode(tok.apply_chat_template(faces[path].model_validate(body).template_messages()))


@pytest.fixture(scope="module")
def toks(tiny_chat_model):
    return Tokenizer(str(tiny_chat_model)), KeyMaker(load_tokenizer(str(tiny_chat_model)))


@pytest.mark.parametrize("name", list(AGREE))
def test_the_router_keys_a_body_on_the_ids_the_worker_prefills(toks, name):
    tok, keys = toks
    path, body = AGREE[name]
    want = worker_ids(tok, path, body)
    assert keys.for_body(path, body).token_ids == want, name


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=DIFFER[n][2]))
                                  for n in DIFFER])
def test_known_differences(toks, name):
    tok, keys = toks
    path, body, _ = DIFFER[name]
    assert keys.for_body(path, body).token_ids == worker_ids(tok, path, body), name
