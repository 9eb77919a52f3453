"""What every route needs: the engine client, the tokenizer, the configs; and the shared steps
from a validated body to an engine request (tokenize, check lengths and sampling params)."""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from common.tenants import TenantTable, effective_salt
from hicache import salt
from serving import ipc as m
from serving.config import EngineConfig
from serving.scheduler.prompt_check import PromptError, check_budget, check_prompt
from serving.scoped_ids import scoped, session_key
from serving.server.config import ServerConfig
from serving.server.engine_client import EngineClient
from serving.server.errors import APIError, quoted
from serving.server.metrics import ServerMetrics
from serving.server.session_ids import check_session_id
from serving.server.tenants import CURRENT
from serving.structs.bootstrap import Bootstrap
from serving.structs.logprob_options import LogprobOptions
from serving.structs.sampling_params import InvalidRequest, SamplingParams
from serving.tokenizer import Tokenizer, TooManyTokens

GREEDY_EPS = 1e-6
DRAINING = ("this server is draining (POST /drain or a SIGTERM with --drain-on-shutdown; POST /undrain ends "
            "it): it admits no new requests; send them to another worker")  # serving/server/drain_api.py


@dataclass
class ServerContext:
    engine_config: EngineConfig
    server: ServerConfig
    client: EngineClient
    tokenizer: Tokenizer | None
    metrics: ServerMetrics
    tenants: TenantTable | None = None  # --api-keys-file
    draining: bool = False  # POST /drain (serving/server/drain_api.py): no new generation is admitted
    drains_running: int = 0  # drains not yet reported (POST /undrain waits for them: a 409)

    @property
    def info(self) -> dict[str, Any]:
        return self.client.info

    @property
    def context_len(self) -> int:
        return int(self.info["context_len"])

    @property
    def model_name(self) -> str:
        return str(self.info["served_model_name"])

    @property
    def model_names(self) -> frozenset[str]:
        """The names a request's ``model`` may give: the served name (``--served-model-name``,
        default the model path), the model path, and the path's last component."""
        path = str(self.info["model_path"])
        return frozenset({self.model_name, path, os.path.basename(path.rstrip("/"))} - {""})

    def check_model(self, model: str) -> str:
        """The served name when ``model`` names the served model, else a 404 in OpenAI's shape."""
        if model not in self.model_names:
            raise APIError(404, f"The model {quoted(model)} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found", kind="invalid_request_error")
        return self.model_name

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send token ids")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the text is not valid unicode (it has a lone surrogate escape)") from None
        try:  # a huge text is refused once it is known to be over the context (serving/tokenizer.py)
            return self.tokenizer.encode(text, max_tokens=self.context_len - 1)
        except TooManyTokens:
            raise APIError(400, f"the prompt has at least {self.context_len} tokens (counting stopped there); "
                                f"this model's context length is {self.context_len}") from None

    def prompt_ids(self, text: str) -> list[int]:
        """A raw-text prompt (completions, /generate, Ollama's generate, /cache lookups): its ids with the
        tokenizer's BOS where it adds one (Tokenizer.prompt_ids); a chat template's text is encoded as is."""
        return self.tokenizer.prompt_ids(self.encode(text))

    def chat_ids(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """``template_kwargs``: SGLang's ``chat_template_kwargs`` (the template's own variables)."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; chat needs one")
        try:
            text = self.tokenizer.apply_chat_template(messages, **(template_kwargs or {}))
        except InvalidRequest as e:
            raise APIError(400, str(e)) from None
        except Exception as e:  # a template that raises on these messages (e.g. role order)
            raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
        return self.encode(text)

    def default_max_tokens(self, prompt_len: int) -> int:
        """OpenAI's default: generate until the end of the context."""
        return max(self.context_len - prompt_len, 0)

    def make_request(
        self,
        input_ids: list[int],
        params: dict[str, Any],
        session_id: str | None,
        rid: str | None = None,
        param_name: str = "max_tokens",
        prompt_param: str = "input_ids",
        bootstrap: Bootstrap | None = None,
        cache_salt: str | None = None,
        logprobs: LogprobOptions | None = None,
    ) -> m.GenerateReq:
        """Check what can be checked here (the engine checks the rest) and build the message.
        ``cache_salt`` (vLLM's field) subdivides the caller's tenant's cache space. A client's
        ``rid`` and ``session_id`` are in its tenant's own namespace: the message's are scoped
        here (serving/scoped_ids.py); answers give the client's back (ReqState.rid)."""
        if self.draining:
            raise APIError(503, DRAINING)
        check_salt(cache_salt)
        if session_id is not None:
            check_session_id(session_id)  # every generation route's session_id comes through here
        tenant = CURRENT.get()
        try:
            sp = SamplingParams.from_dict(params)
        except InvalidRequest as e:
            raise APIError(400, str(e)) from None
        except TypeError as e:
            raise APIError(400, f"invalid sampling parameters: {e}") from None
        if sp.seed is not None and not -(2**63) <= sp.seed < 2**64:
            raise APIError(400, "seed must fit in 64 bits", param="seed")
        if 0 < sp.temperature < GREEDY_EPS:  # SGLang's rule: a vanishing temperature is greedy
            sp = dataclasses.replace(sp, temperature=0.0)
        try:  # the prompt's rules have one owner (serving/scheduler/prompt_check.py)
            check_prompt(input_ids, int(self.info["vocab_size"]), self.context_len, prompt_param)
            check_budget(len(input_ids), sp.max_new_tokens, self.context_len, param_name)
        except PromptError as e:
            raise APIError(400, str(e), param=e.param) from None
        name = None if tenant is None else tenant.name
        return m.GenerateReq(  # a client's rid and session id in its tenant's namespace (serving/scoped_ids.py)
            rid=uuid.uuid4().hex if not rid else scoped(name, rid), input_ids=input_ids, sampling_params=sp,
            session_id=None if session_id is None else session_key(name, session_id), bootstrap=bootstrap,
            cache_salt=effective_salt(tenant, cache_salt), tenant=name, logprobs=logprobs,
        )


def check_salt(cache_salt: str | None) -> None:
    error = salt.salt_error(cache_salt)
    if error is not None:
        raise APIError(400, error, param="cache_salt")


def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx
