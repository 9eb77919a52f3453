"""The engine as the KV control API sees it (serving/cache/kv_control.py, kv_lookup.py, kv_drain.py):
a typed protocol, so this package names what it reads without importing ``serving.engine`` (which
imports it). serving/engine/core.py's ``EngineCore`` is the one implementation
(tests/cache/test_kv_control_leases.py checks that it offers every member)."""

from __future__ import annotations

from typing import Protocol

from hicache.hiradix import HiRadixTree
from hicache.hiradix.quota import TenantLedger
from serving.cache.req_cache import ReqCache
from serving.cache.storage_controller import StorageController
from serving.config import EngineConfig
from serving.structs.request import Req


class RequestQueues(Protocol):
    """The scheduler's queues: a drain persists only once both are empty."""

    running: list[Req]
    waiting: list[Req]


class ControlCore(Protocol):
    """The engine's config, tree, request cache (its transfers flushed before pages are read), tenant
    ledger, L3 controller (None: no L3) and request queues."""

    config: EngineConfig
    tree: HiRadixTree
    req_cache: ReqCache
    ledger: TenantLedger
    storage: StorageController | None
    scheduler: RequestQueues
