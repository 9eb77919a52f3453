"""``OpenAI(model, base_url=..., api_key=...)``: any OpenAI-compatible server (the ``openai`` SDK).

- Chat models (``is_chat_model=True``, the default): a ``gen`` must open an assistant turn
  (``assistant(gen(...))``); the program's finished messages go to ``/v1/chat/completions``
  (the server applies its template). Completion models: the program's text goes to
  ``/v1/completions``.
- ``regex`` travels in ``extra_body`` (SGLang's extra field), ``json_schema`` as
  ``response_format``.
- ``select`` needs prompt logprobs: ``/v1/completions`` with ``echo``, ``logprobs`` and
  ``max_tokens: 0`` over ``text + choice`` (the choice's tokens are those that end past the
  text, by ``text_offset``: a token merged across the boundary counts). With a chat model the
  text needs the model's chat template, so ``select`` then needs ``chat_template=`` (a Jinja
  string or a local model folder); a server that gives no prompt logprobs is a clear error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from serving.lang import chat_template as ct
from serving.lang.backends.base import Backend, sdk_call
from serving.lang.choices import ChoiceLogprobs
from serving.lang.errors import BackendError

_PARAMS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "stop": "stop",
           "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty", "seed": "seed"}
_EXTRA = ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "regex", "ebnf")


class OpenAI(Backend):
    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None,
                 is_chat_model: bool = True, chat_template: str | None = None, timeout: float = 600.0) -> None:
        import openai

        self.model_name = model_name
        self.is_chat_model = is_chat_model
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY", "none"),
                                    timeout=timeout, max_retries=0)
        if chat_template is not None and os.path.isdir(chat_template):
            chat_template = ct.from_model_folder(chat_template)
        self.template_known = chat_template is not None
        self.chat_template = ct.resolve(chat_template)

    def _call(self, fn: Any, **kw: Any) -> Any:
        import openai

        return sdk_call(openai, self.client.base_url, fn, **kw)

    def _kwargs(self, params: dict[str, Any]) -> dict[str, Any]:
        kw: dict[str, Any] = {"model": self.model_name}
        extra: dict[str, Any] = {}
        for k, v in params.items():
            if k in _PARAMS:
                kw[_PARAMS[k]] = v
            elif k == "json_schema":
                kw["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "output", "schema": json.loads(v)}}
            elif k in _EXTRA:
                extra[k] = v
            else:
                raise BackendError(f"the OpenAI backend does not pass {k!r}")
        if extra:
            kw["extra_body"] = extra
        return kw

    def _chat_messages(self, ex: Any) -> list[dict[str, str]]:
        if ex.role != "assistant" or ex.text[ex.role_start:]:
            raise BackendError("a chat model generates only at the start of an assistant turn: "
                               "write assistant(gen(...)) (or use is_chat_model=False)")
        return list(ex.messages)

    def generate(self, ex: Any, params: dict[str, Any], gen: Any) -> tuple[str, dict[str, Any]]:
        if self.is_chat_model:
            r = self._call(self.client.chat.completions.create, messages=self._chat_messages(ex),
                           **self._kwargs(params))
            text = r.choices[0].message.content or ""
        else:
            r = self._call(self.client.completions.create, prompt=ex.text, **self._kwargs(params))
            text = r.choices[0].text
        return text, _meta(r)

    def generate_stream(self, ex: Any, params: dict[str, Any], gen: Any) -> Iterator[tuple[str, dict | None]]:
        opts = {"stream": True, "stream_options": {"include_usage": True}}
        if self.is_chat_model:
            stream = self._call(self.client.chat.completions.create, messages=self._chat_messages(ex),
                                **self._kwargs(params), **opts)
        else:
            stream = self._call(self.client.completions.create, prompt=ex.text, **self._kwargs(params), **opts)
        for chunk in stream:
            if chunk.choices:
                c = chunk.choices[0]
                yield ((c.delta.content or "") if self.is_chat_model else c.text), None
            elif chunk.usage is not None:
                yield "", _meta(chunk)

    def choice_logprobs(self, ex: Any, choices: list[str], unconditional: bool) -> list[ChoiceLogprobs]:
        if self.is_chat_model and not self.template_known:
            raise BackendError("select on a chat model needs prompt logprobs over the templated text: pass "
                               "OpenAI(..., chat_template=<Jinja string or model folder>) or use RuntimeEndpoint")
        scored = self._echo([ex.text + c for c in choices], len(ex.text))
        alone = self._echo(list(choices), 0) if unconditional else [None] * len(choices)
        out = []
        for (toks, lps), u in zip(scored, alone, strict=True):
            uncond = None
            if u is not None:
                tail = [0.0 if x is None else x for x in u[1]][-len(lps):] if lps else []
                uncond = [0.0] * (len(lps) - len(tail)) + tail
            out.append(ChoiceLogprobs(toks, [0.0 if x is None else x for x in lps], uncond))
        return out

    def _echo(self, prompts: list[str], start: int) -> list[tuple[list[Any], list[Any]]]:
        """Each prompt's tokens that end past ``start`` and their logprobs (one batched request)."""
        r = self._call(self.client.completions.create, model=self.model_name, prompt=prompts, max_tokens=0,
                       echo=True, logprobs=1, temperature=0)
        out: list[tuple[list[Any], list[Any]]] = [([], [])] * len(prompts)
        for choice in r.choices:
            lp = choice.logprobs
            if lp is None or not lp.token_logprobs or lp.text_offset is None:
                raise BackendError("the server gives no prompt logprobs (completions with echo and logprobs)")
            ends = [*lp.text_offset[1:], len(prompts[choice.index]) + 1]  # a token crossing ``start`` counts
            keep = [i for i, end in enumerate(ends) if end > start]
            out[choice.index] = ([lp.tokens[i] for i in keep], [lp.token_logprobs[i] for i in keep])
        return out

def _meta(r: Any) -> dict[str, Any]:
    u = getattr(r, "usage", None)
    if u is None:
        return {}
    details = getattr(u, "prompt_tokens_details", None)
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "cached_tokens": getattr(details, "cached_tokens", None) or 0}

