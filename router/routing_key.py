"""From a request body to a :class:`RouteRequest`: the routing key, ids and session.

With a tokenizer (``tokenizer_path``, or the workers' tokenizer folder when it exists on this
machine), the router reproduces what the worker will prefill: the chat messages in their one
normal form (hicache/prompt_form.py, which the worker's API faces use too) through the chat
template, then ``encode`` without special tokens (serving/tokenizer.py does the same), so keys
are on token ids and the exact cache view can compute page keys. Without one, the key is the
request's text (messages joined by role), and token ids sent by the client are used as they are.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hicache.prompt_form import anthropic_chat, ollama_chat, ollama_generate, openai_chat
from router.approx_tree import text_key, token_key
from router.policies import RouteRequest

log = logging.getLogger("hicache.router")


def load_tokenizer(path: str | None) -> Any:
    if not path or not (
        os.path.exists(os.path.join(path, "tokenizer.json"))
        or os.path.exists(os.path.join(path, "tokenizer_config.json"))
    ):
        return None
    try:
        from hicache.tokenizer_load import load_tokenizer  # the worker's loader: the same ids and template

        return load_tokenizer(path)
    except Exception as e:  # no transformers, or a folder it cannot read: route on text
        log.warning("cannot load the tokenizer at %s (%s); routing on text", path, e)
        return None


class KeyMaker:
    def __init__(self, tokenizer: Any = None) -> None:
        self.tok = tokenizer

    def for_body(self, path: str, body: dict[str, Any]) -> RouteRequest:
        sid = body.get("session_id") if isinstance(body.get("session_id"), str) else None
        try:
            ids, text = self._prompt(path, body)
        except Exception:  # a body the worker will reject anyway: route it anywhere
            ids, text = None, ""
        if ids is not None:
            try:
                return RouteRequest(token_key(ids), ids, sid)
            except ValueError:
                pass
        return RouteRequest(text_key(text) if text else "", None, sid)

    def _prompt(self, path: str, body: dict[str, Any]) -> tuple[list[int] | None, str]:
        messages = CHAT_PATHS[path](body) if path in CHAT_PATHS else None
        if messages is not None:
            if self.tok is not None and getattr(self.tok, "chat_template", None):
                text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                return self.encode(text), text
            return None, "".join(f"<{m.get('role')}>{m.get('content')}" for m in messages)
        if path in ("/v1/completions", "/api/generate"):
            prompt = body.get("prompt")
        else:  # /generate
            prompt = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: route on its first prompt
        if isinstance(prompt, list):
            return list(prompt), ""
        if isinstance(prompt, str):
            return (self.encode(prompt) if self.tok is not None else None), prompt
        return None, ""

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))


# chat routes: the body's messages as the worker's chat template sees them (hicache/prompt_form.py,
# the worker's API faces' own normal form: one owner)
CHAT_PATHS = {
    "/v1/chat/completions": lambda b: openai_chat(b.get("messages"), b.get("tools")),
    "/v1/messages": lambda b: anthropic_chat(b.get("system"), b.get("messages"), b.get("tools")),  # Anthropic
    "/api/chat": lambda b: ollama_chat(b.get("messages")),  # Ollama
    # Ollama's /api/generate goes through the chat template unless it is raw
    "/api/generate": lambda b: None if b.get("raw") else ollama_generate(b.get("prompt"), b.get("system")),
}
