"""``Anthropic(model, base_url=..., api_key=...)``: any Anthropic Messages API server (the
``anthropic`` SDK): this project's ``/v1/messages``, or Anthropic's own.

- Chat only (as SGLang's ``Anthropic`` backend): a ``gen`` opens an assistant turn
  (``assistant(gen(...))``); the program's system messages become ``system``, the rest
  ``messages`` (the server applies its template).
- Sampling: ``max_new_tokens`` -> ``max_tokens`` (128 when a ``gen`` gives none: the API needs
  one), ``stop`` -> ``stop_sequences``; ``temperature``, ``top_p``, ``top_k`` travel in the
  body (current SDKs have no arguments for them). Constrained decoding (``regex``,
  ``json_schema``, ...), penalties and ``select`` (no prompt logprobs in the Messages API) are
  clear errors naming the call.
- ``meta_info``: ``prompt_tokens`` = input + cache read + cache creation tokens (Anthropic's
  three parts of the prompt), ``completion_tokens``, ``cached_tokens`` = cache read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from serving.lang import chat_template as ct
from serving.lang.backends.base import Backend, sdk_call
from serving.lang.errors import BackendError

DEFAULT_MAX_TOKENS = 128
_BODY = ("temperature", "top_p", "top_k")


class Anthropic(Backend):
    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        import anthropic

        self.model_name = model_name
        self.client = anthropic.Anthropic(base_url=base_url, timeout=timeout, max_retries=0,
                                          api_key=api_key or os.environ.get("ANTHROPIC_API_KEY", "none"))
        self.chat_template = ct.resolve(None)

    def _call(self, fn: Any, **kw: Any) -> Any:
        import anthropic

        return sdk_call(anthropic, self.client.base_url, fn, **kw)

    def _kwargs(self, ex: Any, params: dict[str, Any]) -> dict[str, Any]:
        if ex.role != "assistant" or ex.text[ex.role_start:]:
            raise BackendError("the Anthropic backend generates only at the start of an assistant turn: "
                               "write assistant(gen(...))")
        system = "\n\n".join(m["content"] for m in ex.messages if m["role"] == "system")
        kw: dict[str, Any] = {"model": self.model_name, "max_tokens": DEFAULT_MAX_TOKENS,
                              "messages": [m for m in ex.messages if m["role"] != "system"]}
        if system:
            kw["system"] = system
        body: dict[str, Any] = {}
        for k, v in params.items():
            if k == "max_new_tokens":
                kw["max_tokens"] = v
            elif k == "stop":
                kw["stop_sequences"] = [v] if isinstance(v, str) else list(v)
            elif k in _BODY:
                body[k] = v
            else:
                raise BackendError(f"the Anthropic backend does not pass {k!r} (the Messages API has no such field)")
        if body:
            kw["extra_body"] = body
        return kw

    def generate(self, ex: Any, params: dict[str, Any], gen: Any) -> tuple[str, dict[str, Any]]:
        r = self._call(self.client.messages.create, **self._kwargs(ex, params))
        return "".join(b.text for b in r.content if b.type == "text"), _meta(r.usage)

    def generate_stream(self, ex: Any, params: dict[str, Any], gen: Any) -> Iterator[tuple[str, dict | None]]:
        stream = self._call(self.client.messages.create, stream=True, **self._kwargs(ex, params))
        usage: dict[str, Any] = {}
        for event in stream:
            if event.type == "message_start":
                usage = _meta(event.message.usage)
            elif event.type == "content_block_delta" and event.delta.type == "text_delta":
                yield event.delta.text, None
            elif event.type == "message_delta" and event.usage is not None:
                usage["completion_tokens"] = event.usage.output_tokens
        yield "", usage


def _meta(u: Any) -> dict[str, Any]:
    if u is None:
        return {}
    read = getattr(u, "cache_read_input_tokens", None) or 0
    created = getattr(u, "cache_creation_input_tokens", None) or 0
    return {"prompt_tokens": u.input_tokens + read + created, "completion_tokens": u.output_tokens,
            "cached_tokens": read}

