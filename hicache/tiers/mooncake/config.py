"""Options of the Mooncake storage backend."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class MooncakeConfig:
    """Options of :class:`hicache.tiers.mooncake.store.MooncakeStore` (the keys of its config mapping)."""

    master_server_address: str = "127.0.0.1:50051"
    metadata_server: str = "http://127.0.0.1:8080/metadata"
    local_hostname: str = ""  # "": the address of the interface that routes to the master
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_mb: int = 4096  # memory this client contributes to the store
    local_buffer_mb: int = 64
    key_prefix: str = "hicache/"
    timeout_s: float = 2.0
    setup_timeout_s: float = 10.0
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    resetup_after: int = 5

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.setup_timeout_s <= 0 or self.backoff_s <= 0:
            raise ValueError("timeouts and backoff must be positive")
        if self.global_segment_mb < 0 or self.local_buffer_mb <= 0:
            raise ValueError("global_segment_mb must be >= 0 and local_buffer_mb > 0")
        if ":" not in self.master_server_address:
            raise ValueError(f"master_server_address must be host:port, got {self.master_server_address!r}")

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> MooncakeConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(config) - known
        if unknown:
            raise ValueError(f"unknown mooncake storage options {sorted(unknown)}; known: {sorted(known)}")
        return cls(**config)


def route_address(host_port: str) -> str:
    """The local address the kernel would use to reach ``host:port`` (no packet is sent): the
    default of ``local_hostname``."""
    host, _, port = host_port.rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port)))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
