"""KV transports by name (``TRANSPORTS``, ``make_transport``; each backend imported on first use,
so a server without PD never loads one) and ``raw_write_gbps`` (a backend's raw rate, for
benchmarks). The interface every backend implements: serving/disagg/transport_base.py.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable

from serving.disagg.transport_base import KVTransport, TransportConfig


def _mooncake(config: TransportConfig) -> KVTransport:
    return _load("serving.disagg.transport_mooncake", "MooncakeTransport", "mooncake-transfer-engine-non-cuda")(config)


def _nixl(config: TransportConfig) -> KVTransport:
    return _load("serving.disagg.transport_nixl", "NixlTransport", "nixl-cu12")(config)


def _load(module: str, cls: str, package: str) -> Callable[[TransportConfig], KVTransport]:
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise RuntimeError(f"KV transport needs the {package} package ({e}); see `make setup`") from e


def _cuda_ipc(config: TransportConfig) -> KVTransport:
    return _load("serving.disagg.transport_cuda_ipc", "CudaIpcTransport", "torch (CUDA build)")(config)


TRANSPORTS: dict[str, Callable[[TransportConfig], KVTransport]] = {
    "mooncake": _mooncake, "nixl": _nixl, "cuda_ipc": _cuda_ipc}


def make_transport(name: str, config: TransportConfig | None = None) -> KVTransport:
    """A transport by name; ValueError for an unknown name, RuntimeError when its package is missing."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; choices: {', '.join(sorted(TRANSPORTS))}")
    return TRANSPORTS[name](config or TransportConfig())


def raw_write_gbps(a: KVTransport, b: KVTransport, nbytes: int, chunk: int, repeat: int = 3) -> float:
    """Raw rate (GB/s, 1e9) of one batched write of ``nbytes`` in ``chunk``-byte pieces from ``a``'s first
    registered buffer to ``b``'s; chunks land in reverse order so nothing coalesces. Best of ``repeat``
    after one warm-up write (connection set-up)."""
    (sa, na), (sb, nb) = a.regions[0], b.regions[0]
    if nbytes > min(na, nb) or chunk <= 0 or nbytes % chunk:
        raise ValueError(f"nbytes={nbytes} must be a multiple of chunk={chunk} and fit both buffers ({na}, {nb})")
    k = nbytes // chunk
    src = [sa + i * chunk for i in range(k)]
    dst = [sb + (k - 1 - i) * chunk for i in range(k)]
    peer = b.endpoint()
    a.write(peer, src, dst, [chunk] * k)
    best = float("inf")
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        a.write(peer, src, dst, [chunk] * k)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
