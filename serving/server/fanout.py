"""``n > 1`` choices that share one prefill, and scoring requests (``max_tokens: 0``).

n choices of one prompt: the prompt is computed once by a one-token warm-up request; when it
finishes its full pages are in the tree, and the n choices (submitted then) find them there and
compute only the prompt's last partial page before they decode. With a ``seed``, choice ``i``
samples with ``seed + i`` (the same seed would give n identical samples).

Scoring: a request with ``max_tokens: 0`` that asks for prompt logprobs (``echo`` +
``logprobs``, or ``return_logprob`` from a ``logprob_start_len`` inside the prompt) needs a
prefill, which a zero-token request never runs: it runs with one token, which the API drops
(:func:`trim_scoring`).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from serving import ipc as m
from serving.server.engine_client import EngineClient
from serving.server.req_handle import ReqState, run_all

MAX_N = 128


def check_n(n: int | None, name: str = "n") -> int:
    from serving.server.errors import APIError

    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise APIError(400, f"{name} must be an integer in [1, {MAX_N}]", param=name)
    return n


def choices(req: m.GenerateReq, n: int) -> list[m.GenerateReq]:
    """``n`` copies of a request, each with its own rid (and seed)."""
    if n == 1:
        return [req]
    if req.bootstrap is not None:
        from serving.server.errors import APIError

        raise APIError(400, "n > 1 is not supported on a PD disaggregated request", param="n")
    sp = req.sampling_params
    return [dataclasses.replace(req, rid=f"{req.rid}-{i}", sampling_params=sp if sp.seed is None else
                                dataclasses.replace(sp, seed=sp.seed + i)) for i in range(n)]


async def warm_prefix(client: EngineClient, reqs: list[m.GenerateReq]) -> list[ReqState]:
    """Compute each prompt once (a greedy one-token request per prompt) so that their choices
    share its KV through the tree; its session, salt and tenant are the request's. Returns the
    warm-up states: their prompt and cached tokens are the prompts' usage."""
    warm = [dataclasses.replace(r, rid=uuid.uuid4().hex, sampling_params={"max_new_tokens": 1, "temperature": 0},
                                logprobs=None, bootstrap=None) for r in reqs]
    return await run_all(client, warm)


def scoring(params: dict[str, Any], prompt_logprobs: bool) -> bool:
    """A zero-token request that needs a prefill (see the module docstring)."""
    return prompt_logprobs and params.get("max_new_tokens") == 0


def trim_scoring(st: ReqState) -> ReqState:
    """The state of a scoring request as if it generated nothing."""
    st.output_ids = []
    st.finish_reason = {"type": "length", "length": 0}
    for key in ("output", "output_top", "output_ids"):
        st.logprobs.pop(key, None)
    return st
