"""Prompt normalisation has one owner (issue 28): common/prompt_form.py. The worker's API faces
(``template_messages()`` in serving/server/) hand their validated values to it, the router's key
(router/routing_key.py) the raw body; this test holds both to the same token ids, body by body,
tools, the developer role and content parts included (where they differed before the one owner)."""

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
OPENAI_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time",
                                                "parameters": {"type": "object", "properties": {}}}}

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
    "openai-developer": ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}),
    "openai-content-parts": ("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]}),
    "openai-tools": ("/v1/chat/completions", {"model": "m", "tools": [OPENAI_TOOL], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]}),
    "anthropic-tools": ("/v1/messages", {"model": "m", "max_tokens": 4, "tools": [TOOL],
                                         "messages": [{"role": "user", "content": "What time is it?"}]}),
    "anthropic-tool-blocks": ("/v1/messages", {"model": "m", "max_tokens": 4, "tools": [TOOL], "system": "Be brief.",
                                               "messages": [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_time", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "12:00"}]}]}),
    "ollama-tools": ("/api/chat", {"model": "m", "tools": [OPENAI_TOOL], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": "", "thinking": "A clock.", "tool_calls": [
            {"function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "tool_name": "get_time", "content": "12:00"}]}),
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


@pytest.mark.parametrize("name", list(AGREE))
def test_a_bounded_key_is_a_prefix_of_the_ids_the_worker_prefills(toks, name):
    """A routing key of at most 12 tokens (the tokenizer sees at most 96 characters, the bodies
    are clipped first: router/routing_key.py) is the start of what the worker prefills."""
    tok, keys = toks
    path, body = AGREE[name]
    want = worker_ids(tok, path, body)
    got = KeyMaker(keys.tok, 12).for_body(path, body).token_ids
    assert got and len(got) <= 12 and got == want[: len(got)], (name, got, want[:12])
