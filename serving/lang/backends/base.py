"""What the interpreter needs from a backend (each backend states its own transport).

``ex`` below is the calling state's :class:`serving.lang.interpreter.StreamExecutor`: its
``text`` (the whole program text so far, chat template applied), ``messages`` and
``session_id``. Every method is called from a state's worker thread, several at once; a
backend is thread-safe. Failures are :class:`serving.lang.errors.BackendError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from serving.lang.chat_template import ChatTemplate
from serving.lang.choices import ChoiceLogprobs
from serving.lang.errors import BackendError


class Backend:
    chat_template: ChatTemplate

    def generate(self, ex: Any, params: dict[str, Any], gen: Any) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def generate_stream(self, ex: Any, params: dict[str, Any], gen: Any) -> Iterator[tuple[str, dict | None]]:
        text, meta = self.generate(ex, params, gen)  # a backend without streaming: one chunk
        yield text, meta

    def choice_logprobs(self, ex: Any, choices: list[str], unconditional: bool) -> list[ChoiceLogprobs]:
        raise BackendError(f"{type(self).__name__} cannot score choices: it gives no prompt logprobs")

    def cache_prefix(self, ex: Any) -> None:
        """Make the backend's cache hold ``ex.text`` (before forks). Default: nothing to do."""

    def open_session(self) -> str | None:
        return None

    def close_session(self, session_id: str) -> None:
        return None

    def flush_cache(self) -> None:
        return None


def sdk_call(sdk: Any, base_url: Any, fn: Any, **kw: Any) -> Any:
    """``fn(**kw)`` of an OpenAI or Anthropic SDK client (``sdk``: the ``openai`` / ``anthropic``
    module), its connection and status errors as :class:`BackendError`."""
    try:
        return fn(**kw)
    except sdk.APIConnectionError as e:
        raise BackendError(f"cannot reach the server at {base_url} ({e})") from None
    except sdk.APIStatusError as e:
        raise BackendError(f"the server answered {e.status_code}: {status_message(e)}", e.status_code) from None


def status_message(e: Any) -> str:
    """The message of an SDK's status error (OpenAI's and Anthropic's bodies: ``{"error":
    {"message": ...}}``), or the error's text."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    return str(e)


def sampling_for_server(params: dict[str, Any]) -> dict[str, Any]:
    """SGLang sampling params as /generate takes them (stop as given, None dropped)."""
    return {k: v for k, v in params.items() if v is not None}



HEAL = 2  # prompt tokens before the choice scored as well: a choice may merge with the text's last tokens


def choice_rows(prefix_rows: list[list[Any]], rows: list[list[Any]]) -> list[list[Any]]:
    """The rows (``[logprob, token_id, ...]``, both from the same start position) of a
    ``text + choice`` prompt that belong to the choice: those from the first position where its
    tokens leave the text's own tokens (a choice that merges with the text's last token, such as
    ``" calculator"`` after ``"use a "``, starts at that merged token: token healing)."""
    i = 0
    while i < len(rows) and i < len(prefix_rows) and rows[i][1] == prefix_rows[i][1]:
        i += 1
    return rows[i:]


def logprob_values(rows: list[list[Any]]) -> list[float]:
    return [0.0 if r[0] is None else float(r[0]) for r in rows]

