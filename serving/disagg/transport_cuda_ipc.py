"""``cuda_ipc``: GPU to GPU on one host through CUDA IPC (NVLink / PCIe peer copies).

For PD between GPUs of one machine where neither Mooncake's nor NIXL's GPU build is
available. The receiver exports its registered KV buffer as a CUDA IPC handle (driver API,
``cuIpcGetMemHandle`` of the allocation that holds it); the sender opens it once per peer
(``cuIpcOpenMemHandle`` with lazy peer access) and writes with ``cuMemcpyDtoDAsync`` per
(coalesced) chunk on its own stream, then synchronises that stream, so the bytes are in the
peer's memory when :meth:`write` returns. Like Mooncake and NIXL it is one-sided: the decode
server's scheduler takes no part in the copy.

Concurrency: ``write`` is thread-safe (a lock per peer mapping; a stream per thread). Both
processes must see both GPUs (no ``CUDA_VISIBLE_DEVICES`` split; pick the GPU with
``--device cuda:N``), and be on one host (the endpoint carries the boot id to refuse others).
"""

from __future__ import annotations

import base64
import ctypes
import os
import threading
from typing import Any

import torch

from serving.disagg.transport import KVTransport, TransferError, TransportConfig

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def _driver() -> ctypes.CDLL:
    cu = ctypes.CDLL("libcuda.so.1")
    u64, p64 = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)
    cu.cuMemGetAddressRange_v2.argtypes = [p64, ctypes.POINTER(ctypes.c_size_t), u64]
    cu.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), u64]
    cu.cuIpcOpenMemHandle_v2.argtypes = [p64, _Handle, ctypes.c_uint]
    cu.cuIpcCloseMemHandle.argtypes = [u64]
    cu.cuMemcpyDtoDAsync_v2.argtypes = [u64, u64, ctypes.c_size_t, ctypes.c_void_p]
    cu.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
    return cu


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class CudaIpcTransport(KVTransport):
    name = "cuda_ipc"

    def __init__(self, config: TransportConfig) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda_ipc KV transport needs CUDA GPUs (use mooncake or nixl on CPU)")
        self._cu = _driver()
        self.device = torch.cuda.current_device()
        self._exported: dict[str, Any] | None = None
        self._peers: dict[str, tuple[int, int]] = {}  # handle -> (mapped base, remote base)
        self._lock = threading.Lock()
        self._local = threading.local()

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise TransferError(f"cuda_ipc: {what} failed (CUresult {rc})")

    def _register(self, ptr: int, nbytes: int) -> None:
        torch.cuda.set_device(self.device)
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = self._cu.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
        self._check(rc, "cuMemGetAddressRange")
        handle = _Handle()
        self._check(self._cu.cuIpcGetMemHandle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
        self._exported = {"handle": base64.b64encode(bytes(handle.reserved)).decode(), "alloc_base": base.value,
                          "pid": os.getpid(), "boot_id": _boot_id(), "device": self.device}

    def endpoint(self) -> dict[str, Any]:
        if self._exported is None:
            raise RuntimeError("cuda_ipc: register() the KV buffer before publishing the endpoint")
        return dict(self._exported)

    def describe(self, peer: dict[str, Any]) -> str:
        return f"cuda_ipc peer pid {peer.get('pid')} (GPU {peer.get('device')})"

    def _mapped(self, peer: dict[str, Any]) -> tuple[int, int]:
        """(our address of the peer's allocation, the peer's own address of it)."""
        try:
            key, remote = str(peer["handle"]), int(peer["alloc_base"])
        except (KeyError, TypeError, ValueError):
            raise TransferError(f"cuda_ipc: malformed peer endpoint {peer!r}") from None
        if peer.get("boot_id") != _boot_id():
            raise TransferError(f"cuda_ipc: {self.describe(peer)} is on another host")
        if peer.get("pid") == os.getpid():  # our own memory: same address space
            return remote, remote
        with self._lock:
            if key not in self._peers:
                handle = _Handle()
                handle.reserved = base64.b64decode(key)
                mapped = ctypes.c_uint64()
                rc = self._cu.cuIpcOpenMemHandle_v2(ctypes.byref(mapped), handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                if rc != 0:
                    raise TransferError(f"cuda_ipc: cannot open the memory of {self.describe(peer)} (CUresult {rc}: "
                                        "is the process gone, or its GPU not visible here?)")
                self._peers[key] = (mapped.value, remote)
            return self._peers[key]

    def _write(self, peer: dict[str, Any], src: list[int], dst: list[int], lengths: list[int]) -> None:
        torch.cuda.set_device(self.device)
        mapped, remote = self._mapped(peer)
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        handle = ctypes.c_void_p(stream.cuda_stream)
        copy = self._cu.cuMemcpyDtoDAsync_v2
        shift = mapped - remote
        for s, d, n in zip(src, dst, lengths, strict=True):
            rc = copy(d + shift, s, n, handle)
            if rc != 0:
                raise TransferError(f"cuda_ipc: copy of {n} B to {self.describe(peer)} failed (CUresult {rc})")
        self._check(self._cu.cuStreamSynchronize(handle), "cuStreamSynchronize")

    def _close(self) -> None:
        with self._lock:
            for mapped, _ in self._peers.values():
                self._cu.cuIpcCloseMemHandle(mapped)
            self._peers.clear()
