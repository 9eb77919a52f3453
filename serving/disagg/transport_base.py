"""KV transport for prefill-decode disaggregation: one-sided batched writes of registered memory.

A prefill worker (sender) writes KV bytes straight into a decode worker's (receiver's) registered
buffer. Both sides :meth:`KVTransport.register` their KV buffer once at startup; the receiver
publishes :meth:`KVTransport.endpoint` (JSON) out of band; the sender calls :meth:`KVTransport.write`
with that endpoint. Backends: ``mooncake`` (Mooncake transfer engine, TCP), ``nixl`` (NIXL/UCX) and
``cuda_ipc`` (GPU to GPU on one host).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TransportConfig:
    host: str | None = None  # address peers reach us at (mooncake: its local_hostname); None: the backend's choice
    timeout_s: float = 30.0  # nixl: a write still in flight after this is cancelled and raises TransferError


class TransferError(RuntimeError):
    """A write failed (peer unknown or gone, address not registered, timeout); names the peer."""


class KVTransport(ABC):
    """One endpoint of a KV transport.

    Concurrency contract:
      * ``register()`` every buffer before the first ``write()`` and before publishing ``endpoint()``
        (NIXL's endpoint carries the registrations); call it from one thread (startup).
      * ``write()`` is thread-safe: several sender threads may write at once, to the same or to
        different peers. It blocks the calling thread until the bytes are in the peer's memory.
      * ``endpoint()`` may be called from any thread; ``close()`` once, after all writes returned.
    """

    name: str = ""

    def __init__(self) -> None:
        self.regions: list[tuple[int, int]] = []  # (ptr, nbytes) registered with register()
        self.closed = False

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``nbytes`` at ``ptr``: peers may write into it (receiver) / we read from it (sender)."""
        if ptr <= 0 or nbytes <= 0:
            raise ValueError(f"cannot register ptr={ptr:#x} nbytes={nbytes}")
        self._register(int(ptr), int(nbytes))
        self.regions.append((int(ptr), int(nbytes)))

    def register_tensor(self, t: Any) -> None:
        """Register a tensor's bytes (GPU transports export the tensor's storage instead)."""
        self.register(t.data_ptr(), t.numel() * t.element_size())

    @abstractmethod
    def _register(self, ptr: int, nbytes: int) -> None: ...

    @abstractmethod
    def endpoint(self) -> dict[str, Any]:
        """JSON-serialisable: what a peer needs to write into our registered memory."""

    def write(self, peer: dict[str, Any], src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> None:
        """Copy ``lengths[i]`` bytes from our ``src[i]`` to the peer's ``dst[i]`` for all i, in one batched
        backend call (Mooncake: one per 1024 chunks), blocking until done; on TransferError part of the
        batch may have landed. Neighbouring chunks are coalesced first. Raises TransferError."""
        if self.closed:
            raise TransferError(f"{self.name}: write to {self.describe(peer)} after close()")
        if not (len(src) == len(dst) == len(lengths)):
            raise ValueError(f"src/dst/lengths differ in length: {len(src)}/{len(dst)}/{len(lengths)}")
        s, d, n = coalesce(src, dst, lengths)
        if not n:
            return
        self._write(peer, s, d, n)

    @abstractmethod
    def _write(self, peer: dict[str, Any], src: list[int], dst: list[int], lengths: list[int]) -> None: ...

    def describe(self, peer: dict[str, Any]) -> str:
        """A short name of ``peer`` for messages."""
        return str(peer)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._close()

    def _close(self) -> None:  # noqa: B027 - optional hook
        pass

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def coalesce(src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Merge neighbours where ``src[i]+len[i]==src[i+1]`` and ``dst[i]+len[i]==dst[i+1]``; drop empty chunks."""
    n = np.asarray(lengths, dtype=np.int64)
    if n.size == 0:
        return [], [], []
    if (n < 0).any():
        raise ValueError("negative chunk length")
    keep = n > 0
    s, d, n = np.asarray(src, dtype=np.int64)[keep], np.asarray(dst, dtype=np.int64)[keep], n[keep]
    if n.size == 0:
        return [], [], []
    joined = (s[:-1] + n[:-1] == s[1:]) & (d[:-1] + n[:-1] == d[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    return s[starts].tolist(), d[starts].tolist(), np.add.reduceat(n, starts).tolist()
