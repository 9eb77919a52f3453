"""``RuntimeEndpoint(url, api_key=...)``: this server's native API over HTTP (httpx).

- ``gen``: ``POST /generate`` with the program's whole text (chat template applied client side)
  and SGLang sampling params (``regex`` / ``json_schema`` included); streamed as SSE with
  ``stream=True``. The text's leading part is the previous call's, so the radix tree matches it.
- ``select``: the text alone once as a prefill (``max_new_tokens: 0``: its KV is cached, its
  token count known), then every ``text + choice`` in one batched request with
  ``return_logprob`` from that count, so each choice's token logprobs come from a prefill of
  its own tokens only; the unconditional normalisation adds the choices alone.
- fork: the shared text once as a prefill before the branches (``cache_prefix``).
- sessions: ``/open_session`` / ``/close_session``.
- The chat template: the server's own (``/api/show``), else the tokenizer folder named by
  ``/get_model_info`` when it exists here, else ChatML; or ``chat_template=`` (a Jinja string).

One ``httpx.Client`` (thread-safe) serves every state's worker thread.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from serving.lang import chat_template as ct
from serving.lang.backends.base import (
    HEAL,
    Backend,
    choice_rows,
    logprob_values,
    sampling_for_server,
)
from serving.lang.choices import ChoiceLogprobs
from serving.lang.errors import BackendError


class RuntimeEndpoint(Backend):
    def __init__(self, base_url: str, api_key: str | None = None, verify: Any = None,
                 chat_template: Any = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                   verify=True if verify is None else verify)
        self.model_info = self._request("GET", "/get_model_info")
        self.chat_template = ct.resolve(chat_template if chat_template is not None else self._server_template())

    # -- transport ----------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: Any = None) -> Any:
        try:
            r = self.client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach the server at {self.base_url} ({type(e).__name__}: {e})") from None
        if r.status_code >= 400:
            raise BackendError(f"the server answered {r.status_code}: {_message(r)}", r.status_code)
        return r.json()

    def _server_template(self) -> str | None:
        name = self.model_info.get("served_model_name") or self.model_info.get("model_path")
        try:
            tpl = self._request("POST", "/api/show", {"model": name}).get("template")
        except BackendError:
            tpl = None
        if tpl:
            return tpl
        path = self.model_info.get("tokenizer_path") or self.model_info.get("model_path")
        return ct.from_model_folder(path) if isinstance(path, str) else None

    def _body(self, text: str | list[str], params: dict[str, Any], ex: Any = None, **extra: Any) -> dict[str, Any]:
        body = {"text": text, "sampling_params": sampling_for_server(params), **extra}
        if ex is not None and ex.session_id is not None and isinstance(text, str):
            body["session_id"] = ex.session_id
        return body

    # -- the backend --------------------------------------------------------------------------
    def generate(self, ex: Any, params: dict[str, Any], gen: Any) -> tuple[str, dict[str, Any]]:
        out = self._request("POST", "/generate", self._body(ex.text, params, ex, **_logprob_fields(gen)))
        return out["text"], out["meta_info"]

    def generate_stream(self, ex: Any, params: dict[str, Any], gen: Any) -> Iterator[tuple[str, dict | None]]:
        body = self._body(ex.text, params, ex, stream=True, **_logprob_fields(gen))
        seen = ""
        try:
            with self.client.stream("POST", "/generate", json=body) as r:
                if r.status_code >= 400:
                    r.read()
                    raise BackendError(f"the server answered {r.status_code}: {_message(r)}", r.status_code)
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise BackendError(f"the stream failed: {_error_text(chunk)}")
                    text = chunk["text"]
                    delta, seen = text[len(seen):] if text.startswith(seen) else text, text
                    yield delta, chunk.get("meta_info")
        except httpx.HTTPError as e:
            raise BackendError(f"cannot reach the server at {self.base_url} ({type(e).__name__}: {e})") from None

    def cache_prefix(self, ex: Any) -> dict[str, Any]:
        return self._request("POST", "/generate", self._body(ex.text, {"max_new_tokens": 0}, ex))["meta_info"]

    def choice_logprobs(self, ex: Any, choices: list[str], unconditional: bool) -> list[ChoiceLogprobs]:
        start = max(self.cache_prefix(ex)["prompt_tokens"] - HEAL, 0)
        outs = self._request("POST", "/generate", self._body(
            [ex.text] + [ex.text + c for c in choices], {"max_new_tokens": 0}, return_logprob=True,
            logprob_start_len=start))
        prefix_rows = outs[0]["meta_info"]["input_token_logprobs"]
        rows = [choice_rows(prefix_rows, o["meta_info"]["input_token_logprobs"]) for o in outs[1:]]
        toks = [[int(r[1]) for r in rs] for rs in rows]
        unc: list[Any] = [None] * len(choices)
        if unconditional:  # the same tokens without the text before them
            unc = [logprob_values(o["meta_info"]["input_token_logprobs"]) for o in self._request(
                "POST", "/generate", {"input_ids": toks, "sampling_params": {"max_new_tokens": 0},
                                      "return_logprob": True, "logprob_start_len": 0})]
        return [ChoiceLogprobs(t, logprob_values(rs), u) for t, rs, u in zip(toks, rows, unc, strict=True)]

    def open_session(self) -> str:
        return self._request("POST", "/open_session", {})

    def close_session(self, session_id: str) -> None:
        self._request("POST", "/close_session", {"session_id": session_id})

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")

    def get_server_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_server_info")

    def shutdown(self) -> None:
        self.client.close()


def _logprob_fields(gen: Any) -> dict[str, Any]:
    if gen is None or not gen.return_logprob:
        return {}
    out: dict[str, Any] = {"return_logprob": True, "return_text_in_logprobs": gen.return_text_in_logprobs}
    if gen.logprob_start_len is not None:
        out["logprob_start_len"] = gen.logprob_start_len
    if gen.top_logprobs_num is not None:
        out["top_logprobs_num"] = gen.top_logprobs_num
    return out


def _error_text(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(body)


def _message(r: httpx.Response) -> str:
    try:
        return _error_text(r.json())
    except ValueError:
        return r.text[:500]
