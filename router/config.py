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

from router.pd_config import check_pd
from router.urls import check_url

CACHE_VIEWS = ("approx", "events")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 30100
    # more Host names the router answers to (comma-separated; *.domain takes subdomains, * any name):
    # IP literals and localhost always pass, the --host name too off loopback (router/trusted_hosts.py)
    allowed_hosts: str | None = None
    worker_urls: tuple[str, ...] = ()
    policy: str = "cache_aware"  # cache_aware | round_robin | random | power_of_two
    # cache_aware (SGLang's meanings): route to the best prefix match when its match rate is
    # >= cache_threshold, else to the worker with the smallest tree; route to the least loaded
    # worker when max - min load > balance_abs_threshold and max > balance_rel_threshold * min.
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**24  # per worker, in tokens (or characters without a tokenizer)
    eviction_interval_s: float = 60.0
    cache_view: str = "approx"  # approx: what the router sent; events: the workers' cache events
    tokenizer_path: str | None = None  # default: the workers' tokenizer folder when it exists here
    session_affinity: bool = True  # a session_id sticks to its worker while that one is healthy
    # reliability
    health_check_interval_s: float = 2.0
    health_check_timeout_s: float = 2.0
    load_poll_interval_s: float = 0.5
    events_poll_interval_s: float = 0.2
    max_retries: int = 3  # further attempts, on other workers, before a response has started
    retry_backoff_s: float = 0.05  # first backoff; doubles per attempt, with full jitter
    retry_backoff_max_s: float = 1.0
    circuit_failure_threshold: int = 3  # consecutive failures that open a worker's circuit
    circuit_cooldown_s: float = 5.0  # open -> half-open after this long
    max_concurrent_requests: int = 256  # requests forwarded at once
    max_queued_requests: int = 512  # requests waiting for a slot; beyond: HTTP 429
    queue_timeout_s: float = 60.0
    request_timeout_s: float = 600.0
    api_key: str | None = None  # enforced at the router; also sent to workers (unless worker_api_key)
    worker_api_key: str | None = None
    # the workers' tenants (serving's --api-keys-file): tenant keys are accepted and passed on, and
    # routing keys on each request's tenant + cache_salt scope (router/tenancy.py)
    api_keys_file: str | None = None
    log_level: str = "info"
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
    pd_disaggregation: bool = False
    prefill_urls: tuple[tuple[str, int | None], ...] = ()
    decode_urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from router.policies import POLICIES  # late: importing the config pulls in no policy (nor httpx)
        from router.trusted_hosts import parse_allowed_hosts  # late: it imports the app's error shapes

        if not 1 <= self.port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.cache_view not in CACHE_VIEWS:
            raise ValueError(f"cache_view must be one of {', '.join(CACHE_VIEWS)}, got {self.cache_view!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.tokenizer_workers < 0 or not 0 <= self.shared_l3_weight <= self.l2_weight <= 1:
            raise ValueError("tokenizer_workers must be >= 0 and 0 <= shared_l3_weight <= l2_weight <= 1")
        for name in ("max_tree_size", "max_concurrent_requests", "circuit_failure_threshold", "max_sessions",
                     "max_leases", "max_worker_pages"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_retries < 0 or self.max_queued_requests < 0:
            raise ValueError("max_retries and max_queued_requests must be >= 0")
        for f in dataclasses.fields(self):
            if f.name.endswith("_s") and getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name} must be positive")
        for url in self.worker_urls:
            check_url(url)
        parse_allowed_hosts(self.allowed_hosts)  # ValueError naming a malformed entry
        check_pd(self)  # PD mode's workers (router/pd_config.py)


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
