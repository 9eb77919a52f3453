"""ServerConfig and the config file: YAML sections validated once against the frozen dataclasses.

A config file has up to four sections, each mapping onto one frozen dataclass::

    model:     -> serving.config.ModelConfig
    cache:     -> hicache.config.CacheConfig
    scheduler: -> serving.config.SchedulerConfig
    server:    -> ServerConfig (below)

The pydantic models used for validation are generated from the dataclasses, so a field
added to a dataclass is accepted in YAML (and gets a CLI flag) without being repeated here.
Unknown keys are errors (extra=forbid); values are not coerced across types (a string is
never silently read as a number).
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from hicache.config import CacheConfig
from hicache.config_fields import check_choices, choice
from serving.config import EngineConfig, ModelConfig, SchedulerConfig
from serving.process_config import EngineProcessConfig

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("mooncake", "nixl", "cuda_ipc")  # serving.disagg's transports


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # the address to listen on (0.0.0.0: every interface)
    port: int = 30000  # the HTTP port
    # when set, every route but /health needs "Authorization: Bearer <key>"; `hicache serve` also
    # reads it from the environment variable HICACHE_API_KEY (which, unlike a flag, ps does not show)
    api_key: str | None = None
    # YAML of tenants (key -> tenant, optional quota_pages per tier): each key's requests run in that
    # tenant's isolated cache space (serving/server/tenants.py); --api-key stays the default tenant
    api_keys_file: str | None = None
    # names the Host header may give besides IP literals and localhost (and, when listening beyond
    # loopback, --host and the machine's host name), comma-separated; "*.example.com" takes its
    # subdomains, "*" any name (serving/server/trusted_hosts.py: the DNS rebinding guard)
    allowed_hosts: str | None = None
    # SGLang's flag: the chat template to render chats with instead of the tokenizer's: a Jinja file
    # (.jinja, or a .json with a "chat_template" key) or the template text itself
    chat_template: str | None = None
    # SGLang's flag: the format chat answers' tool calls are parsed from (qwen25, llama3, mistral,
    # deepseekv3, gpt-oss: serving/parsing/tool_registry.py); unset: tool calls stay text
    tool_call_parser: str | None = None
    # SGLang's flag: how a chat answer's reasoning is split off into reasoning_content (qwen3,
    # deepseek-r1, gpt-oss: serving/parsing/reasoning_registry.py); unset: it stays in the content
    reasoning_parser: str | None = None
    max_request_bytes: int = 8 * 2**20  # larger request bodies get HTTP 413
    session_idle_timeout_s: float = 1800.0  # sessions unused this long are closed by the engine loop
    # open sessions (/open_session) on this server, and per --api-keys-file tenant: 429 past them
    max_sessions: int = 4096
    max_sessions_per_tenant: int = 1024  # open sessions per --api-keys-file tenant: 429 past it
    # pin leases (/cache/pin, and demote_on_idle sessions' idle leases) on this server, and per tenant: 429
    max_pin_leases: int = 4096
    max_pin_leases_per_tenant: int = 1024  # pin leases per tenant: 429 past it
    # the longest /cache/pin lease (ttl_s past it: 400); idle sessions' leases and cache_control
    # breakpoints are cut to it. Anthropic's longest cache TTL is 1 h
    max_pin_ttl_s: float = 3600.0
    # the server-wide pin budget: the share of L2 that all tenants' pin leases (/cache/pin, cache_control
    # breakpoints, idle sessions') may hold together, a page held by several leases counted once; the rest
    # of L2 stays free to stage pages through to L3 and back. Past it /cache/pin gets 409 and a breakpoint
    # is not pinned (its usage says why); each tenant pins at most min(its L2 quota or half of L2, what is left)
    max_pinned_l2_fraction: float = 0.5
    log_level: str = choice("info", LOG_LEVELS)  # of the server's and the engine's logs
    # one line per HTTP request (method, route, status, duration) on the hicache.access logger at INFO
    # (/health and /metrics at DEBUG); 5xx warnings and hicache_http_requests_total stay either way
    access_log: bool = True
    enable_debug_endpoints: bool = False  # POST /debug/check_integrity (tests, operators)
    graceful_shutdown_timeout_s: float = 5.0  # open streams get this long after SIGTERM
    # SIGTERM first drains (serving/server/drain_api.py: 503 for new requests, running ones finish, every
    # cached page L3 lacks is written), then shuts down
    drain_on_shutdown: bool = False
    drain_timeout_s: float = 60.0  # how long a drain waits for running requests before it aborts them
    enable_cache_events: bool = False  # GET /cache_events: pages added / evicted per tier (for routers)
    # at shutdown the engine process gets this long to finish (with L3 it first writes every cached
    # page on to L3); past it, it is killed and the pages not yet written are lost
    shutdown_timeout_s: float = 120.0
    # the engine watchdog (SGLang's flag name): /health answers 503 once the engine has made no
    # progress (no step, no finished request) for this many seconds while work is pending, or its
    # loop has not turned at all for as long, pending work or not (serving/server/watchdog.py)
    watchdog_timeout: float = 300.0
    # every call from the HTTP process to the engine (control routes, a request's acceptance)
    # fails with 504 when the engine has not answered within this many seconds
    engine_call_timeout_s: float = 60.0
    max_json_depth: int = 128  # request bodies nested deeper (arrays / objects) get HTTP 400
    # a request's head (request line and headers) must arrive within this many seconds of the connection
    # opening (or of the next request's first byte), else HTTP 408 and the connection is closed (slowloris)
    header_timeout_s: float = 30.0
    body_timeout_s: float = 300.0  # a request's whole body must arrive within this many seconds, else 408
    body_idle_timeout_s: float = 30.0  # and with no gap between its bytes longer than this, else 408
    # uvicorn's flag: an idle kept-alive connection is closed after this many seconds; longer than
    # clients keep one to reuse (httpx and the OpenAI SDK: 5 s), so a reuse never races the close
    timeout_keep_alive: float = 75.0
    # uvicorn's flag: past this many open connections plus running requests, new requests get HTTP 503
    # (unset: no limit; idle and slow connections count too, so a low value lets them lock clients out)
    limit_concurrency: int | None = None
    # data parallelism (SGLang's --dp-size): this many engine replicas behind the built-in cache-aware
    # router, in one command (serving/launch/dp.py); they share the configured L3
    dp_size: int = 1
    # Prefill-decode disaggregation (SGLang's flags; docs/pd.md). null: colocated
    disaggregation_mode: str = choice("null", DISAGGREGATION_MODES)  # null: prefill and decode colocated
    disaggregation_transfer_backend: str = choice("mooncake", TRANSFER_BACKENDS)  # cuda_ipc: GPUs of one host
    disaggregation_bootstrap_port: int = 8998  # prefill: where decode servers register their pages
    disaggregation_decode_enable_radix_cache: bool = False  # decode: reuse cached prefixes, fetch the rest
    # address peers reach this server's transport at (Mooncake: its local hostname); default: the
    # transport's own choice of a LAN address
    disaggregation_transfer_host: str | None = None
    disaggregation_bootstrap_timeout_s: float = 60.0  # a room whose other half has not shown up fails

    def __post_init__(self) -> None:
        check_choices(self)  # log_level, disaggregation_mode, disaggregation_transfer_backend
        if self.dp_size < 1:
            raise ValueError("dp_size must be at least 1")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_request_bytes <= 0:
            raise ValueError("max_request_bytes must be positive")
        if self.session_idle_timeout_s <= 0:
            raise ValueError("session_idle_timeout_s must be positive")
        for name in ("max_sessions", "max_sessions_per_tenant", "max_pin_leases", "max_pin_leases_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not 0 < self.max_pin_ttl_s <= 86400:
            raise ValueError(f"max_pin_ttl_s must be in (0, 86400], got {self.max_pin_ttl_s:g}")
        if not 0 < self.max_pinned_l2_fraction <= 1:
            raise ValueError(f"max_pinned_l2_fraction must be in (0, 1], got {self.max_pinned_l2_fraction:g}")
        from serving.parsing.reasoning_registry import reasoning_parser
        from serving.parsing.tool_registry import tool_parser

        tool_parser(self.tool_call_parser)  # ValueError naming the known names
        reasoning_parser(self.reasoning_parser)
        if self.allowed_hosts is not None:
            from serving.server.trusted_hosts import parse_allowed_hosts

            parse_allowed_hosts(self.allowed_hosts)  # ValueError naming a malformed entry
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError("drain_timeout_s must be in [0, 3600]")
        if self.graceful_shutdown_timeout_s < 0:
            raise ValueError("graceful_shutdown_timeout_s must be >= 0")
        if self.shutdown_timeout_s <= 0:
            raise ValueError("shutdown_timeout_s must be positive")
        if self.watchdog_timeout <= 0:
            raise ValueError("watchdog_timeout must be positive")
        if self.engine_call_timeout_s <= 0:
            raise ValueError("engine_call_timeout_s must be positive")
        if self.max_json_depth < 2:
            raise ValueError("max_json_depth must be at least 2")
        for name in ("header_timeout_s", "body_timeout_s", "body_idle_timeout_s", "timeout_keep_alive"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError("limit_concurrency must be at least 1")
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            raise ValueError("disaggregation_bootstrap_port must be in 1..65535, "
                             f"got {self.disaggregation_bootstrap_port}")
        if self.disaggregation_bootstrap_timeout_s <= 0:
            raise ValueError("disaggregation_bootstrap_timeout_s must be positive")

    def engine_process(self) -> EngineProcessConfig:
        """The settings the engine process reads (its own frozen config; see serving/process_config.py)."""
        return EngineProcessConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineProcessConfig)})


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "server": ServerConfig,
}


class ConfigError(ValueError):
    """A config file or flag value that cannot be used; the message names the field."""


@dataclass(frozen=True)
class AppConfig:
    engine: EngineConfig
    server: ServerConfig


def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints of a config dataclass's fields."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _section_model(name: str, cls: type) -> type[BaseModel]:
    fields = {fname: (tp, None) for fname, tp in field_types(cls).items()}
    return create_model(f"{name}_section", __config__=ConfigDict(extra="forbid", strict=True), **fields)


_FILE_MODEL: type[BaseModel] = create_model(
    "config_file",
    __config__=ConfigDict(extra="forbid", strict=True),
    **{name: (_section_model(name, cls) | None, None) for name, cls in SECTIONS.items()},
)


def _format_errors(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def _flag_hint(cls: type, message: str) -> str:
    """`` (--the-flag)`` when ``message`` starts with a field of ``cls`` (as the dataclasses' checks do)."""
    first = message.split(" ", 1)[0]
    names = {f.name for f in dataclasses.fields(cls)}
    return f" (--{first.replace('_', '-')})" if first in names else ""


def build_config(sections: dict[str, Any], source: str = "config") -> AppConfig:
    """Validate ``{"model": {...}, "cache": {...}, ...}`` once and build the frozen configs."""
    if not isinstance(sections, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections ({', '.join(SECTIONS)})")
    try:
        parsed = _FILE_MODEL.model_validate(sections)
    except ValidationError as e:
        raise ConfigError(f"{source}: {_format_errors(e)}") from None
    built: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        section = getattr(parsed, name)
        values = section.model_dump(exclude_unset=True) if section is not None else {}
        try:
            built[name] = cls(**values)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{source}: {name}: {e}{_flag_hint(cls, str(e))}") from None
    try:  # checks across sections (e.g. an fp8 kv_cache_dtype with a lossy hicache encoding)
        engine = EngineConfig(model=built["model"], cache=built["cache"], scheduler=built["scheduler"])
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    return AppConfig(engine=engine, server=built["server"])


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw sections of a YAML file (validated later, together with CLI overrides)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections ({', '.join(SECTIONS)})")
    return data


def load_config(
    path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None
) -> AppConfig:
    """Dataclass defaults, then the file, then ``overrides`` (``{section: {field: value}}``)."""
    sections: dict[str, Any] = read_config_file(path) if path is not None else {}
    for name, values in (overrides or {}).items():
        current = sections.get(name)
        if current is None:
            current = {}
        if not isinstance(current, dict):
            break  # let validation name the bad section
        sections[name] = {**current, **values}
    return build_config(sections, str(path) if path is not None else "config")


def read_chat_template(value: str) -> str:
    """The Jinja text ``--chat-template`` names: a file (``.jinja``, or ``.json`` with a
    ``chat_template`` key, as SGLang takes them) or the template text itself; ConfigError (one line)
    otherwise. SGLang's built-in template names are not known here: give the file."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"--chat-template {value}: cannot read it ({e.strerror}); give a .jinja file, a .json "
                          "with a \"chat_template\" key, or the template text (SGLang's built-in template names "
                          "are not known here)") from None
    if path.suffix == ".json":
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"--chat-template {value}: a .json needs a \"chat_template\" string") from None
        if not isinstance(text, str):
            raise ConfigError(f"--chat-template {value}: a .json needs a \"chat_template\" string")
    if not text.strip():
        raise ConfigError(f"--chat-template {value}: the file is empty")
    return text
