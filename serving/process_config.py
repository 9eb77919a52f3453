"""EngineProcessConfig: the part of the server's settings the engine process uses.

Built once by :meth:`serving.server.config.ServerConfig.engine_process` (which validated every
value and owns the defaults and the meaning of each field), frozen, and handed to the spawned
engine process, so that process never imports the HTTP side's config (nor, through it, an HTTP
framework). Read by the engine loop (sessions, KV control limits, tenants, cache events), its
entry point (the log level) and the PD roles (serving.disagg: the ``disaggregation_*`` fields
and ``host``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineProcessConfig:
    """Each field is the ServerConfig field of the same name (see serving/server/config.py)."""

    host: str
    log_level: str
    session_idle_timeout_s: float
    max_sessions: int
    max_sessions_per_tenant: int
    max_pin_leases: int
    max_pin_leases_per_tenant: int
    max_pin_ttl_s: float
    max_pinned_l2_fraction: float
    api_keys_file: str | None
    enable_cache_events: bool
    disaggregation_mode: str
    disaggregation_transfer_backend: str
    disaggregation_bootstrap_port: int
    disaggregation_decode_enable_radix_cache: bool
    disaggregation_transfer_host: str | None
    disaggregation_bootstrap_timeout_s: float
