"""RouterConfig: one frozen dataclass, validated once from YAML (and CLI flags) with pydantic.

A router config file is a flat mapping of RouterConfig's fields (see configs/router.yaml).
Like the worker's config (serving/server/config.py), the pydantic model is generated from the
dataclass, unknown keys are errors and values are never coerced across types. Lists in YAML
become tuples here.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from common.json_depth import DEFAULT_MAX_DEPTH
from hicache.config_fields import check_choices, choice
from router.pd_config import check_pd
from router.urls import check_not_self, check_url

CACHE_VIEWS = ("approx", "events")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _policy_names() -> list[str]:
    from router.policies import POLICIES  # late: importing the config pulls in no policy (nor httpx)

    return list(POLICIES)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"  # the address the router listens on
    port: int = 30100  # the port the router listens on
    # more Host names the router answers to (comma-separated; *.domain takes subdomains, * any name):
    # IP literals and localhost always pass, the --host name too off loopback (router/trusted_hosts.py)
    allowed_hosts: str | None = None
    # the workers, http(s)://host:port each (no path, query or user info; never the router itself);
    # --worker-urls replaces the config file's list
    worker_urls: tuple[str, ...] = ()
    # how a worker is chosen: the cached prefix (SGLang's), in turn, at random, or the less loaded of two
    policy: str = choice("cache_aware", _policy_names)
    # cache_aware (SGLang's meanings): route to the best prefix match when its match rate is
    # >= cache_threshold, else to the worker with the smallest tree; route to the least loaded
    # worker when max - min load > balance_abs_threshold and max > balance_rel_threshold * min.
    cache_threshold: float = 0.3  # cache_aware: the best prefix match wins when it covers this share of the prompt
    balance_abs_threshold: int = 64  # cache_aware: imbalanced when max - min load is over this (and see below)
    balance_rel_threshold: float = 1.5  # cache_aware: ... and max load > this x min load: the least loaded wins
    max_tree_size: int = 2**24  # the approximate tree per worker, in tokens (or characters without a tokenizer)
    eviction_interval_s: float = 60.0  # how often the approximate tree is trimmed to max_tree_size
    # approx: what the router sent each worker; events: the workers' cache events (--enable-cache-events)
    cache_view: str = choice("approx", CACHE_VIEWS)
    tokenizer_path: str | None = None  # the tokenizer folder to key on (unset: the workers', when it exists here)
    session_affinity: bool = True  # a session_id sticks to its worker while that one is healthy
    # reliability
    health_check_interval_s: float = 2.0  # how often each worker's /health is checked
    health_check_timeout_s: float = 2.0  # a health check (or load poll) slower than this failed
    load_poll_interval_s: float = 0.5  # how often each worker's /get_load is polled
    events_poll_interval_s: float = 0.2  # cache_view events: how often each worker's /cache_events is polled
    max_retries: int = 3  # further attempts, on other workers, before a response has started
    retry_backoff_s: float = 0.05  # first backoff; doubles per attempt, with full jitter
    retry_backoff_max_s: float = 1.0  # the longest backoff between two attempts
    circuit_failure_threshold: int = 3  # consecutive failures that open a worker's circuit
    circuit_cooldown_s: float = 5.0  # open -> half-open after this long
    max_concurrent_requests: int = 256  # requests forwarded at once
    max_queued_requests: int = 512  # requests waiting for a slot; beyond: HTTP 429
    queue_timeout_s: float = 60.0  # a request that waited this long for a slot gets HTTP 429
    request_timeout_s: float = 600.0  # a worker that sends nothing for this long failed the attempt
    # the admin key: every route but /health needs it (or a tenant's key); only it may add, remove and
    # flush workers and list them (router/admin.py); sent to the workers unless worker_api_key is set
    api_key: str | None = None
    worker_api_key: str | None = None  # the workers' --api-key, when it is not the router's api_key
    # the workers' tenants (serving's --api-keys-file): tenant keys are accepted and passed on, and
    # routing keys on each request's tenant + cache_salt scope (router/tenancy.py)
    api_keys_file: str | None = None
    # a router without api_key and api_keys_file: let any client that reaches it add and remove
    # workers (POST /add_worker, /remove_worker); off, only --worker-urls / the config's workers
    enable_worker_registration: bool = False
    max_request_bytes: int = 8 * 2**20  # larger request bodies get HTTP 413 (the workers' default too)
    max_json_depth: int = DEFAULT_MAX_DEPTH  # request bodies nested deeper (arrays / objects) get HTTP 400
    # a request's head (request line and headers) must arrive within this many seconds of the connection
    # opening (or of the next request's first byte), else HTTP 408 and the connection is closed (slowloris)
    header_timeout_s: float = 30.0
    body_timeout_s: float = 300.0  # a request's whole body must arrive within this many seconds, else 408
    body_idle_timeout_s: float = 30.0  # and with no gap between its bytes longer than this, else 408
    # uvicorn's flag: an idle kept-alive connection is closed after this many seconds; longer than
    # clients keep one to reuse (httpx and the OpenAI SDK: 5 s), so a reuse never races the close
    timeout_keep_alive: float = 75.0
    # routing keys cover at most this many tokens of a prompt, and the tokenizer sees at most 8 characters
    # per token of it (unset: the workers' context length, else 131072)
    max_routing_tokens: int | None = None
    log_level: str = choice("info", LOG_LEVELS)  # the router's logging level
    # fleet scale (bounded memory; each cap counts what it dropped in /list_workers)
    max_sessions: int = 100_000  # session affinity entries (LRU)
    max_leases: int = 100_000  # pin lease -> worker entries (LRU)
    max_worker_pages: int = 2_000_000  # cache_view events: page keys kept per worker (LRU)
    tokenizer_workers: int = 2  # processes for chat templating + tokenization (0: on the event loop)
    l2_weight: float = 0.6  # cache_view events: a page on a worker's L2 counts this much of an L1 page
    # a page some worker holds on L2 is written to the shared L3 (Mooncake Store): every worker gets this
    # much credit for it (0: no shared L3, or do not count it)
    shared_l3_weight: float = 0.0
    # prefill-decode disaggregation (router/pd.py): prefill workers as (url, bootstrap port or None:
    # ask the worker), decode workers as urls; `policy` picks the prefill, the least loaded decodes
    pd_disaggregation: bool = False  # prefill-decode disaggregation: --prefill and --decode workers (router/pd.py)
    prefill_urls: tuple[tuple[str, int | None], ...] = ()  # PD mode: the prefill workers (--prefill)
    decode_urls: tuple[str, ...] = ()  # PD mode: the decode workers (--decode)

    def __post_init__(self) -> None:
        from router.trusted_hosts import parse_allowed_hosts  # late: it imports the app's error shapes

        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        check_choices(self)  # policy, cache_view, log_level
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.tokenizer_workers < 0 or not 0 <= self.shared_l3_weight <= self.l2_weight <= 1:
            raise ValueError("tokenizer_workers must be >= 0 and 0 <= shared_l3_weight <= l2_weight <= 1")
        for name in ("max_tree_size", "max_concurrent_requests", "circuit_failure_threshold", "max_sessions",
                     "max_leases", "max_worker_pages", "max_request_bytes", "timeout_keep_alive"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_retries < 0 or self.max_queued_requests < 0:
            raise ValueError("max_retries and max_queued_requests must be >= 0")
        for f in dataclasses.fields(self):
            if f.name.endswith("_s") and getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name} must be positive")
        if self.max_json_depth < 2:
            raise ValueError("max_json_depth must be at least 2")
        if self.max_routing_tokens is not None and self.max_routing_tokens <= 0:
            raise ValueError("max_routing_tokens must be positive (or unset: the workers' context length)")
        urls = tuple(check_not_self(check_url(u), self.host, self.port) for u in self.worker_urls)
        object.__setattr__(self, "worker_urls", urls)  # frozen: normalized once, here
        parse_allowed_hosts(self.allowed_hosts)  # ValueError naming a malformed entry
        check_pd(self)  # PD mode's workers (router/pd_config.py)
        for url in (*(u for u, _ in self.prefill_urls), *self.decode_urls):
            check_not_self(url, self.host, self.port)
        if self.enable_worker_registration and self.worker_api_key and not (self.api_key or self.api_keys_file):
            raise ValueError(
                "enable_worker_registration on a router without api_key would send worker_api_key to any worker "
                "anyone registers: give the router an api_key (then /add_worker takes it) or drop one of them")


class ConfigError(ValueError):
    """A config file or flag value that cannot be used; the message names the field."""


def field_types() -> dict[str, Any]:
    hints = typing.get_type_hints(RouterConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RouterConfig)}


def _yaml_type(tp: Any) -> Any:
    if tp == tuple[tuple[str, int | None], ...]:  # prefill_urls: [url, ...] or [[url, port], ...]
        return list[str | list[str | int | None]]
    return list[str] if tp == tuple[str, ...] else tp


_MODEL: type[BaseModel] = create_model(
    "router_config",
    __config__=ConfigDict(extra="forbid", strict=True),
    **{name: (_yaml_type(tp) | None, None) for name, tp in field_types().items()},
)


def build_config(values: dict[str, Any], source: str = "config") -> RouterConfig:
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of router settings")
    try:
        parsed = _MODEL.model_validate(values)
    except ValidationError as e:
        msg = "; ".join(".".join(str(x) for x in err["loc"]) + ": " + err["msg"] for err in e.errors())
        raise ConfigError(f"{source}: {msg}") from None
    kwargs = parsed.model_dump(exclude_unset=True)
    if kwargs.get("worker_urls") is not None:
        kwargs["worker_urls"] = tuple(u.rstrip("/") for u in kwargs["worker_urls"])
    try:
        return RouterConfig(**{k: v for k, v in kwargs.items() if v is not None or _nullable(k)})
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{source}: {e}") from None


def _nullable(name: str) -> bool:
    tp = field_types()[name]
    return type(None) in typing.get_args(tp)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> RouterConfig:
    """Dataclass defaults, then the YAML file, then ``overrides`` (CLI flags)."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of router settings")
        values.update(data or {})
    values.update(overrides or {})
    return build_config(values, str(path) if path is not None else "config")
