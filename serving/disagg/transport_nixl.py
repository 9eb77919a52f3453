"""KV transport over NIXL (UCX backend).

Our endpoint is ``{"agent": name, "metadata": base64(agent metadata)}``; the metadata carries our
registrations and UCX connection info, so publish it after ``register()``. A write is one NIXL
transfer request over all chunks (``initialize_xfer`` + ``transfer``), polled to completion.

UCX picks its transports from the environment, read when the agent is created: on a CPU-only host
use ``UCX_TLS=tcp,self,sm`` (and ``UCX_NET_DEVICES=lo`` when both ends share the host).
"""

from __future__ import annotations

import base64
import importlib
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import numpy as np

from serving.disagg.transport_base import KVTransport, TransferError, TransportConfig


def _api():
    """``nixl._api`` (the meta package) or the CUDA-flavoured wheel it forwards to (``nixl_cu12``...)."""
    errors = []
    for mod in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(mod)
        except ImportError as e:
            errors.append(f"{mod}: {e}")
    raise ImportError("; ".join(errors))


_nixl = _api()
if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL's Python logger prints INFO lines to stdout
    logging.getLogger("nixl").setLevel(logging.WARNING)


PUMP_S = 0.0005


class NixlTransport(KVTransport):
    """Thread-safe: the agent runs in NIXL's strict sync mode (its calls are serialised internally,
    transfers proceed in UCX's progress thread) and the per-peer cache is guarded by a lock."""

    name = "nixl"

    def __init__(self, config: TransportConfig) -> None:
        super().__init__()
        self.timeout_s = config.timeout_s
        self.agent_name = f"hicache-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        conf = _nixl.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"],
                                       sync_mode=_nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent = _nixl.nixl_agent(self.agent_name, conf)
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"NIXL has no UCX backend here (plugins: {self.agent.plugin_list})")
        self._reg: list[Any] = []  # nixlRegDList per register(), for deregister_memory
        self._peers: dict[str, str] = {}  # agent name -> the metadata we loaded for it
        self._lock = threading.Lock()
        self._metadata: str | None = None
        # NIXL's own progress thread busy-polls UCX (a whole core per agent, always); instead a pump
        # thread progresses the worker (get_new_notifs) every PUMP_S, so that writes into this
        # agent's memory over UCX's TCP transport, which need the target to progress, complete
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._progress, name="hicache-nixl-progress", daemon=True)
        self._pump.start()

    def _register(self, ptr: int, nbytes: int) -> None:
        try:
            self._reg.append(self.agent.register_memory([(ptr, nbytes, 0, "")], "DRAM"))
        except Exception as e:
            raise RuntimeError(f"NIXL register_memory({ptr:#x}, {nbytes}) failed: {e!r}") from e
        with self._lock:
            self._metadata = None

    def endpoint(self) -> dict[str, Any]:
        with self._lock:
            if self._metadata is None:
                self._metadata = base64.b64encode(self.agent.get_agent_metadata()).decode("ascii")
            return {"agent": self.agent_name, "metadata": self._metadata}

    def describe(self, peer: dict[str, Any]) -> str:
        return f"nixl peer {peer.get('agent', '?')!s}"

    def _peer(self, peer: dict[str, Any]) -> str:
        """The peer's agent name, loading its metadata once (again when it changed)."""
        name, md = peer.get("agent"), peer.get("metadata")
        if not isinstance(name, str) or not isinstance(md, str):
            raise TransferError(f"{self.describe(peer)}: not a nixl endpoint (needs 'agent' and 'metadata')")
        with self._lock:
            if self._peers.get(name) == md:
                return name
            try:
                if name in self._peers:
                    del self._peers[name]
                    self.agent.remove_remote_agent(name)
                loaded = self.agent.add_remote_agent(base64.b64decode(md))
            except Exception as e:
                raise TransferError(f"{self.describe(peer)}: cannot load its metadata: {e!r}") from e
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != name:
                self.agent.remove_remote_agent(loaded)
                raise TransferError(f"{self.describe(peer)}: its metadata names agent {loaded!r}")
            self._peers[name] = md
            return name

    def _write(self, peer: dict[str, Any], src: list[int], dst: list[int], lengths: list[int]) -> None:
        name = self._peer(peer)
        n = np.asarray(lengths, dtype=np.uint64)
        zero = np.zeros_like(n)
        local = self.agent.get_xfer_descs(np.column_stack((np.asarray(src, dtype=np.uint64), n, zero)), "DRAM")
        remote = self.agent.get_xfer_descs(np.column_stack((np.asarray(dst, dtype=np.uint64), n, zero)), "DRAM")
        what = f"nixl write of {len(lengths)} chunks ({int(n.sum())} bytes) to {name}"
        try:
            handle = self.agent.initialize_xfer("WRITE", local, remote, name)
        except Exception as e:
            raise TransferError(f"{what}: rejected ({e!r}): unknown peer, or an address outside the "
                                "registered memory of either side") from e
        try:
            state = self.agent.transfer(handle)
            deadline, pause = time.monotonic() + self.timeout_s, 1e-5
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"{what}: not done after {self.timeout_s}s")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"{what}: failed ({state}); peer gone?")
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"{what}: {e!r}") from e
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # still active and not cancellable: NIXL frees it with the agent
                pass

    def _progress(self) -> None:
        while not self._stop.wait(PUMP_S):
            try:
                self.agent.get_new_notifs()
            except Exception:  # noqa: BLE001 - closing: the agent is going away
                return

    def _close(self) -> None:
        self._stop.set()
        self._pump.join(5)
        with self._lock:
            for name in list(self._peers):
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:
                    pass
            self._peers.clear()
        for reg in self._reg:
            self.agent.deregister_memory(reg)
        self._reg.clear()
        self.agent = None
