"""The rules a prompt must pass, in one place (no torch: the HTTP process imports it too).

- :func:`check_prompt`: a non-empty list of token ids, each an integer in ``[0, vocab)``, shorter
  than the context. The HTTP process checks it before it sends a request
  (``serving.server.context.ServerContext.make_request``, the KV control API's prompts in
  ``serving.server.cache_api``), so the 400 names the API's field; the engine checks it once per
  request (``EngineCore.make_request``) for callers that reach it directly (the offline Engine,
  the frontend language's engine backend).
- :func:`check_budget`: the prompt plus the tokens to generate fit in the context (the HTTP
  APIs' ``max_tokens`` rule; the engine stops a request at the context's end instead).
- :func:`check_fits`: the prompt fits in the KV cache (``Scheduler.validate``: only the engine
  knows the cache's size).
"""

from __future__ import annotations

from typing import Any

from serving.structs.sampling_params import InvalidRequest


class PromptError(InvalidRequest):
    """A prompt that breaks a rule; ``param`` is the request field to name (None: the prompt as a whole)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_prompt(input_ids: Any, vocab_size: int, context_len: int, param: str = "input_ids") -> None:
    """Raise PromptError unless ``input_ids`` is a non-empty list of integers in ``[0, vocab_size)``
    shorter than ``context_len``. The length is checked first, before the O(n) scan."""
    n = len(input_ids) if isinstance(input_ids, list) else 0
    if n >= context_len:
        raise PromptError(f"the prompt has {n} tokens; this model's context length is {context_len}")
    if not isinstance(input_ids, list) or not set(map(type, input_ids)) <= {int} or \
            (input_ids and not (0 <= min(input_ids) and max(input_ids) < vocab_size)):  # type(): no bools
        raise PromptError(f"{param}: token ids must be in [0, {vocab_size})", param)
    if n == 0:
        raise PromptError("the prompt is empty")


def check_budget(prompt_len: int, max_new_tokens: int, context_len: int, param: str = "max_tokens") -> None:
    """Raise PromptError (naming ``param``) when the prompt and ``max_new_tokens`` overrun the context."""
    if prompt_len + max_new_tokens > context_len:
        raise PromptError(f"{param} is too large: the prompt has {prompt_len} tokens and {param} is "
                          f"{max_new_tokens}, over this model's context length of {context_len}", param)


def check_fits(prompt_len: int, capacity_tokens: int) -> None:
    """Raise PromptError when the prompt (and the first generated token) cannot fit in the KV cache."""
    if prompt_len + 1 > capacity_tokens:
        raise PromptError(f"the prompt has {prompt_len} tokens; the KV cache holds {capacity_tokens}")
