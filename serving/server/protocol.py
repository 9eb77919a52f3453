"""Request bodies: OpenAI chat / completions and SGLang's native /generate.

Every model forbids unknown fields and does not coerce types (``"10"`` is not a number).
Fields that OpenAI's API reference or SGLang (0.5.x ``GenerateReqInput``, ``SamplingParams``,
its OpenAI routes) define but HiCache does not implement are accepted at their neutral value
and a 400 naming them otherwise: each model's ``neutral_fields`` table (serving.compat_fields).
Fields accepted and ignored with any value are those that cannot change the answer
(``user``, ``ChatMessage.name``, labels, tracing, routing hints).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.prompt_form import openai_chat, openai_message
from serving import compat_fields
from serving.runner.logprob_meta import MAX_TOP_LOGPROBS
from serving.server.chat_output import ToolRequest, check_choice
from serving.server.openai_tools import FunctionTool, ToolCall, check_tool_fields, openai_tool_choice
from serving.structs.bootstrap import Bootstrap
from serving.structs.grammar_spec import response_format_params

Strict = ConfigDict(extra="forbid", strict=True)
Stop = str | list[str] | None


class StrictModel(BaseModel):
    model_config = Strict
    neutral_fields: ClassVar[Mapping[str, tuple[Any, ...]]] = {}  # serving.compat_fields

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data: Any) -> Any:
        return compat_fields.drop_neutral(data, cls.neutral_fields, cls.model_fields)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class BootstrapFields(StrictModel):
    """PD disaggregation (SGLang's fields): the prefill server's bootstrap address and the
    request's room, set by a PD router. Lists (one per prompt) for a batched /generate."""

    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None

    def bootstrap(self, i: int, n: int) -> Bootstrap | None:
        """Prompt ``i`` of ``n``'s bootstrap (None: not a PD request). Raises ValueError."""
        given = [self.bootstrap_host is not None, self.bootstrap_port is not None, self.bootstrap_room is not None]
        if not any(given):
            return None
        if not all(given):
            raise ValueError("bootstrap_host, bootstrap_port and bootstrap_room go together")
        out = {}
        for name, key in (("bootstrap_host", "host"), ("bootstrap_port", "port"), ("bootstrap_room", "room")):
            v = getattr(self, name)
            if isinstance(v, list):
                if len(v) != n:
                    raise ValueError(f"{name}: a list of {len(v)} for {n} prompts")
                v = v[i]
            out[key] = v
        if not 1 <= out["port"] <= 65535:
            raise ValueError("bootstrap_port must be in 1..65535")
        if not 0 <= out["room"] < 2**63:
            raise ValueError("bootstrap_room must be in [0, 2**63)")
        return Bootstrap(**out)


class SGLangExtras(BootstrapFields):
    """Sampling knobs SGLang accepts on its OpenAI routes, plus HiCache's session id."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    regex: str | None = None  # structured output: the text matches this regex
    ebnf: str | None = None  # structured output: the text matches this EBNF grammar (root rule "root")
    session_id: str | None = None
    cache_salt: str | None = None  # vLLM's field: subdivides the caller's tenant's cache space (hicache.salt)


class OpenAISampling(SGLangExtras):
    model: str
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    stop: Stop = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # OpenAI's end-user id: accepted and ignored
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None  # text | json_object | json_schema (structured output)

    @model_validator(mode="after")
    def _unsupported(self) -> OpenAISampling:
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        self.grammar_params()  # validates response_format / regex / ebnf
        return self

    def grammar_params(self) -> dict[str, Any]:
        """Structured output as SGLang sampling params: response_format, regex or ebnf (one)."""
        p = response_format_params(self.response_format)
        given = [k for k, v in (("response_format", p), ("regex", self.regex), ("ebnf", self.ebnf)) if v]
        if len(given) > 1:
            raise ValueError(f"give at most one of response_format (json), regex, ebnf; got {', '.join(given)}")
        return {**p, **({"regex": self.regex} if self.regex else {}), **({"ebnf": self.ebnf} if self.ebnf else {})}

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """SGLang-named sampling params (unset ones left to SamplingParams' defaults)."""
        p: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
        }
        return {**{k: v for k, v in p.items() if v is not None}, **self.grammar_params()}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    neutral_fields = compat_fields.MESSAGE
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted and ignored (not passed to the chat template)
    tool_calls: list[ToolCall] | None = None  # rendered as text (serving/server/openai_tools.py)
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        check_tool_fields(self.role, self.tool_calls, self.tool_call_id)
        return self

    def as_template_dict(self) -> dict[str, Any]:
        return openai_message(self.model_dump())


class ChatCompletionRequest(OpenAISampling):
    neutral_fields = compat_fields.CHAT
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[FunctionTool] | None = None  # rendered as text; calls parsed (serving/server/chat_output.py)
    tool_choice: str | dict[str, Any] | None = None  # auto | none | required | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # false: at most one call
    separate_reasoning: bool = True  # SGLang's: reasoning_content split off (with --reasoning-parser)
    chat_template_kwargs: dict[str, Any] | None = None  # SGLang's: the chat template's variables
    cache_control: dict[str, Any] | None = None  # pins the prompt (serving/server/cache_control.py)

    @model_validator(mode="after")
    def _chat_unsupported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs: must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        request = self.tool_request()  # validates tool_choice
        if request.forced and self.grammar_params():
            raise ValueError("tool_choice: a required or named call cannot be combined with response_format, "
                             "regex or ebnf")
        self.bootstrap(0, 1)  # validates
        return self

    def tool_request(self) -> ToolRequest:
        tools = [t.function.model_dump() for t in self.tools or []]
        choice, name = openai_tool_choice(self.tool_choice)
        check_choice(tools, choice, name, "tool_choice")
        return ToolRequest(tools, choice, name, self.parallel_tool_calls is not False)

    def template_messages(self) -> list[dict[str, Any]]:
        tools = self.tools if self.tool_request().renders else None  # tool_choice none: not shown
        return openai_chat([m.model_dump() for m in self.messages], [t.model_dump() for t in tools or []])

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(OpenAISampling):
    neutral_fields = compat_fields.COMPLETION
    prompt: Any
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs: must be in [0, {MAX_TOP_LOGPROBS}]")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only best_of=1 is supported")
        if self.suffix:
            raise ValueError("suffix: not supported")
        self.prompt = check_prompt(self.prompt, "prompt")
        for i in range(len(self.prompt)):
            self.bootstrap(i, len(self.prompt))  # validates
        return self


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def check_prompt(prompt: Any, name: str, kinds: str = "text+ids") -> list[str] | list[list[int]]:
    """A string, token ids, or a non-empty list of either -> a list of prompts."""
    if "text" in kinds:
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return list(prompt)
    if "ids" in kinds and isinstance(prompt, list) and prompt:
        if _is_ids(prompt):
            return [list(prompt)]
        if all(_is_ids(p) and p for p in prompt):
            return [list(p) for p in prompt]
    what = {
        "text": "a string or a non-empty list of strings",
        "ids": "a non-empty list of token ids (integers) or a list of such lists",
        "text+ids": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    }
    raise ValueError(f"{name}: must be {what[kinds]}")


class GenerateRequest(BootstrapFields):
    """SGLang's native /generate."""

    neutral_fields = compat_fields.GENERATE

    text: Any = None
    input_ids: Any = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    session_id: str | None = None
    cache_salt: str | None = None  # vLLM's field: subdivides the caller's tenant's cache space (hicache.salt)
    cache_control: dict[str, Any] | None = None  # pins the prompt (serving/server/cache_control.py)
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None  # prompt logprobs from this position (-1: none)
    top_logprobs_num: int | None = None
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool = False
    lora_path: None = None

    @model_validator(mode="after")
    def _checks(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if self.top_logprobs_num is not None and not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num: must be in [0, {MAX_TOP_LOGPROBS}]")
        n = len(self.prompts)  # validates
        for i in range(n):
            self.bootstrap(i, n)
        return self

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        if self.text is not None:
            return check_prompt(self.text, "text", "text")
        return check_prompt(self.input_ids, "input_ids", "ids")

    @property
    def batched(self) -> bool:
        return isinstance(self.text, list) or (
            isinstance(self.input_ids, list) and bool(self.input_ids) and isinstance(self.input_ids[0], list)
        )


class OpenSessionRequest(StrictModel):
    session_id: str | None = None
    retention: Any = None  # hints {demote_on_idle, ttl_s}; validated in admin_api (cache_api.Retention)
    capacity_of_str_len: int | None = None  # SGLang's clients send it; sessions here are unbounded


class CloseSessionRequest(StrictModel):
    session_id: str
