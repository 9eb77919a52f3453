"""From a request body to a :class:`RouteRequest`: the routing key, ids and session.

With a tokenizer (``tokenizer_path``, or the workers' tokenizer folder when it exists on this
machine), the router reproduces what the worker will prefill: the chat messages in their one
normal form (common/prompt_form.py, which the worker's API faces use too) through the chat
template, then ``encode`` without special tokens (serving/tokenizer.py does the same), so keys
are on token ids and the exact cache view can compute page keys. Without one, the key is the
request's text (messages joined by role), and token ids sent by the client are used as they are.

A key covers at most ``max_tokens`` tokens of the prompt (RouterConfig.max_routing_tokens: by
default the workers' context length, beyond which they refuse a prompt anyway), and the
tokenizer sees at most :data:`CHARS_PER_TOKEN` characters per token of that: a prompt of any size
costs at most that much work and memory. :func:`clip_body` drops what lies beyond that before a
body is sent to a key process (messages and tools after the ones that fill it, the rest of a
long string); the rendered prompt is cut there, and the last :data:`BOUNDARY_TOKENS` tokens
before a cut are dropped (the worker, seeing what follows, may tokenize them otherwise).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from common.prompt_form import (
    anthropic_chat,
    anthropic_tool_line,
    block_text,
    content_text,
    ollama_chat,
    ollama_generate,
    openai_chat,
    openai_tool_line,
)
from router.approx_tree import text_key, token_key
from router.policies import RouteRequest

log = logging.getLogger("hicache.router")
DEFAULT_ROUTING_TOKENS = 131072  # max_routing_tokens when the workers do not say their context length
CHARS_PER_TOKEN = 8  # the tokenizer sees at most this many characters per token a key may have
BOUNDARY_TOKENS = 8  # dropped before a cut: with the text after it, the worker may merge them otherwise


def load_tokenizer(path: str | None) -> Any:
    if not path or not (
        os.path.exists(os.path.join(path, "tokenizer.json"))
        or os.path.exists(os.path.join(path, "tokenizer_config.json"))
    ):
        return None
    try:
        from common.tokenizer_load import load_tokenizer  # the worker's loader: the same ids and template

        return load_tokenizer(path)
    except Exception as e:  # no transformers, or a folder it cannot read: route on text
        log.warning("cannot load the tokenizer at %s (%s); routing on text", path, e)
        return None


class KeyMaker:
    def __init__(self, tokenizer: Any = None, max_tokens: int = DEFAULT_ROUTING_TOKENS) -> None:
        self.tok = tokenizer
        self.max_tokens = max_tokens
        self.max_chars = max_tokens * CHARS_PER_TOKEN

    def for_body(self, path: str, body: dict[str, Any]) -> RouteRequest:
        sid = body.get("session_id") if isinstance(body.get("session_id"), str) else None
        try:
            ids, text = self._prompt(path, clip_body(path, body, self.max_chars))
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
                return self.encode(text), text[: self.max_chars]
            return None, "".join(f"<{m.get('role')}>{m.get('content')}" for m in messages)[: self.max_chars]
        if path in ("/v1/completions", "/api/generate"):
            prompt = body.get("prompt")
        else:  # /generate
            prompt = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: route on its first prompt
        if isinstance(prompt, list):
            return list(prompt[: self.max_tokens]), ""
        if isinstance(prompt, str):
            return (self.encode(prompt) if self.tok is not None else None), prompt[: self.max_chars]
        return None, ""

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``'s first ``max_chars`` characters, at most ``max_tokens`` of them."""
        if len(text) <= self.max_chars:
            ids = list(self.tok.encode(text, add_special_tokens=False))
        else:
            ids = list(self.tok.encode(text[: self.max_chars], add_special_tokens=False))[:-BOUNDARY_TOKENS]
        return ids[: self.max_tokens]


def _clip_list(xs: list[Any], max_chars: int, size: Any, cut_key: str | None = None) -> list[Any]:
    """``xs`` up to and with the item whose sizes' running sum passes ``max_chars``; that item's
    string ``cut_key`` (a message's content) cut to what passes it by one character."""
    total = 0
    for i, x in enumerate(xs):
        total += size(x)
        if total > max_chars:
            last = x
            if cut_key is not None and isinstance(x, dict) and isinstance(x.get(cut_key), str):
                last = {**x, cut_key: x[cut_key][: len(x[cut_key]) - (total - max_chars) + 1]}
            return [*xs[:i], last]
    return xs


def _message_chars(m: Any) -> int:
    return len(content_text(m.get("content"))) if isinstance(m, dict) else 0


def _tool_chars(line: Any) -> Any:
    def size(tool: Any) -> int:
        try:
            return len(line(tool)) if isinstance(tool, dict) else 0
        except (TypeError, ValueError):  # not JSON: the worker refuses it
            return 0
    return size


TOOL_LINES = {"/v1/chat/completions": openai_tool_line, "/v1/messages": anthropic_tool_line}  # who renders tools


def clip_body(path: str, body: dict[str, Any], max_chars: int) -> dict[str, Any]:
    """``body`` without what lies beyond the first ``max_chars`` characters of the prompt it makes
    (a copy, when anything was dropped): strings cut after ``max_chars + 1`` characters (still
    longer than the cut, so :meth:`KeyMaker.encode` knows it cuts), a batch's prompts but the first,
    messages, tools and system blocks after the one whose text passes ``max_chars``. Each
    item's size counts only text it renders to (never more), so the prompt rendered from the
    rest agrees with the whole one up to ``max_chars`` where a template renders items in order."""
    out = body

    def put(key: str, value: Any) -> None:
        nonlocal out
        if out is body:
            out = dict(body)
        out[key] = value

    for key in ("prompt", "text", "system"):
        v = body.get(key)
        if isinstance(v, str) and len(v) > max_chars + 1:
            put(key, v[: max_chars + 1])
        elif key != "system" and isinstance(v, list) and len(v) > 1 and isinstance(v[0], str):
            put(key, [v[0][: max_chars + 1]])  # a batch is keyed on its first prompt
        elif key == "system" and isinstance(v, list):
            put(key, _clip_list(v, max_chars, lambda b: len(block_text(b)) if isinstance(b, dict) else 0))
    sizes = [("messages", _message_chars, "content")]
    if path in TOOL_LINES:
        sizes.append(("tools", _tool_chars(TOOL_LINES[path]), None))
    for key, size, cut_key in sizes:
        v = body.get(key)
        if isinstance(v, list):
            clipped = _clip_list(v, max_chars, size, cut_key)
            if len(clipped) < len(v) or (clipped and clipped[-1] is not v[-1]):
                put(key, clipped)
    return out


# chat routes: the body's messages as the worker's chat template sees them (common/prompt_form.py,
# the worker's API faces' own normal form: one owner)
CHAT_PATHS = {
    "/v1/chat/completions": lambda b: openai_chat(b.get("messages"), b.get("tools")),
    "/v1/messages": lambda b: anthropic_chat(b.get("system"), b.get("messages"), b.get("tools")),  # Anthropic
    "/api/chat": lambda b: ollama_chat(b.get("messages"), b.get("tools")),  # Ollama
    # Ollama's /api/generate goes through the chat template unless it is raw
    "/api/generate": lambda b: None if b.get("raw") else ollama_generate(b.get("prompt"), b.get("system")),
}
