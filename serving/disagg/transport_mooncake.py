"""KV transport over Mooncake's transfer engine (TCP, peer-to-peer handshake: no metadata server).

Our endpoint is ``{"session": "host:rpc_port"}``; a write is one ``batch_transfer_sync_write``
(per 1024 chunks, see below).
The engine listens on all interfaces (0.0.0.0); ``host`` only decides what peers are told.
Mooncake itself checks on the receiving side that every destination lies in registered memory.

Mooncake's TCP transport queues at most ~2048 transfer requests per peer on the sending side
(``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``); a batch beyond that is rejected part-way ("TCP lane
queue-full rejection"), part of it still lands, and the engine may fail that peer for a while after.
So a write goes out as sequential sub-batches of at most :attr:`MooncakeTransport.max_batch` chunks,
one write per peer at a time.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import threading
from typing import Any

from mooncake.engine import TransferEngine

from serving.disagg.transport_base import KVTransport, TransferError, TransportConfig

_SIOCGIFADDR = 0x8915


def default_host() -> str:
    """The first non-loopback IPv4 address of this host's interfaces, else 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, ifname in socket.if_nameindex():
            try:
                req = struct.pack("256s", ifname.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address on it
                continue
            if not addr.startswith("127."):
                return addr
    return "127.0.0.1"


class MooncakeTransport(KVTransport):
    """Thread-safe: writes to different peers run concurrently (the engine is thread-safe and caches
    handshakes and connections per session); writes to one peer are serialised by a per-peer lock,
    so that peer's queue never overflows."""

    name = "mooncake"
    max_batch = 1024  # chunks per batch_transfer_sync_write (the engine's per-peer queue holds ~2048)

    def __init__(self, config: TransportConfig) -> None:
        super().__init__()
        self.host = config.host or default_host()
        self.engine = TransferEngine()
        rc = self.engine.initialize(self.host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"mooncake TransferEngine.initialize({self.host!r}, P2PHANDSHAKE, tcp) failed: rc={rc}")
        self.session = f"{self.host}:{self.engine.get_rpc_port()}"
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def _register(self, ptr: int, nbytes: int) -> None:
        rc = self.engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_memory({ptr:#x}, {nbytes}) failed: rc={rc}")

    def endpoint(self) -> dict[str, Any]:
        return {"session": self.session}

    def describe(self, peer: dict[str, Any]) -> str:
        return f"mooncake peer {peer.get('session', peer)!s}"

    def _write(self, peer: dict[str, Any], src: list[int], dst: list[int], lengths: list[int]) -> None:
        session = peer.get("session")
        if not isinstance(session, str) or ":" not in session:
            raise TransferError(f"{self.describe(peer)}: not a mooncake endpoint (no 'session': 'host:port')")
        with self._locks_lock:
            lock = self._locks.setdefault(session, threading.Lock())
        m = self.max_batch
        with lock:
            for i in range(0, len(lengths), m):
                rc = self.engine.batch_transfer_sync_write(session, src[i : i + m], dst[i : i + m], lengths[i : i + m])
                if rc != 0:
                    raise TransferError(
                        f"mooncake write of {len(lengths)} chunks ({sum(lengths)} bytes) to {session} failed at chunk "
                        f"{i} (rc={rc}): peer gone, or a destination outside its registered memory")

    def _close(self) -> None:
        for ptr, _ in self.regions:
            self.engine.unregister_memory(ptr)
        self.engine = None  # the engine's destructor stops its threads and sockets
