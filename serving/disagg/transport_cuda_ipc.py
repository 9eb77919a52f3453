"""``cuda_ipc``: GPU to GPU on one host through CUDA IPC (NVLink / PCIe peer copies).

For PD between GPUs of one machine where neither Mooncake's nor NIXL's GPU build is
available. The receiver exports the storage of its registered KV tensor with PyTorch's CUDA
IPC (``_share_cuda_``: an IPC handle of the allocation, the storage's offset in it, the
producer's ref counter); the sender maps it once per peer (``_new_shared_cuda``) and writes
each (coalesced) chunk with a peer copy on its own stream, then synchronises that stream, so
the bytes are in the peer's memory when :meth:`write` returns. Like Mooncake and NIXL it is
one-sided: the decode server's scheduler takes no part in the copy.

Concurrency: ``write`` is thread-safe (a lock per peer mapping; a stream per thread). Both
processes must see both GPUs (no ``CUDA_VISIBLE_DEVICES`` split; pick the GPU with
``--device cuda:N``), and be on one host (the endpoint carries the boot id to refuse others).
"""

from __future__ import annotations

import base64
import os
import threading
from typing import Any

import numpy as np
import torch

from serving.disagg.transport_base import KVTransport, TransferError, TransportConfig


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(b).decode()


def _unb64(s: str | None) -> bytes | None:
    return None if s is None else base64.b64decode(s)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


_EXPORTED: dict[int, torch.Tensor] = {}  # data_ptr -> bytes view of every storage this process exported


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class CudaIpcTransport(KVTransport):
    name = "cuda_ipc"

    def __init__(self, config: TransportConfig) -> None:
        super().__init__()
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda_ipc KV transport needs CUDA GPUs (use mooncake or nixl on CPU)")
        self.device = torch.cuda.current_device()
        self._local: tuple[int, torch.Tensor] | None = None  # (data_ptr, bytes view) of our registered tensor
        self._exported: dict[str, Any] | None = None
        self._peers: dict[str, tuple[int, torch.Tensor]] = {}  # handle -> (peer's data_ptr, our view of it)
        self._lock = threading.Lock()
        self._tls = threading.local()

    def register_tensor(self, t: torch.Tensor) -> None:
        if t.device.type != "cuda":
            raise ValueError("cuda_ipc registers CUDA tensors only")
        storage = t.untyped_storage()
        dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
        self._exported = {"share": [dev, _b64(handle), size, offset, _b64(rc_handle), rc_offset, _b64(ev_handle),
                                    bool(ev_sync)],
                          "data_ptr": storage.data_ptr(), "pid": os.getpid(), "boot_id": _boot_id(), "device": dev}
        self._local = (storage.data_ptr(), _bytes_view(storage))
        _EXPORTED[storage.data_ptr()] = self._local[1]
        self.regions.append((storage.data_ptr(), storage.nbytes()))

    def _register(self, ptr: int, nbytes: int) -> None:
        raise TypeError("cuda_ipc exports a tensor's storage: call register_tensor(t), not register(ptr, nbytes)")

    def endpoint(self) -> dict[str, Any]:
        if self._exported is None:
            raise RuntimeError("cuda_ipc: register_tensor() the KV buffer before publishing the endpoint")
        return dict(self._exported)

    def describe(self, peer: dict[str, Any]) -> str:
        return f"cuda_ipc peer pid {peer.get('pid')} (GPU {peer.get('device')})"

    def _mapped(self, peer: dict[str, Any]) -> tuple[int, torch.Tensor]:
        """(the peer's data_ptr, our bytes view of its storage)."""
        try:
            share, remote = list(peer["share"]), int(peer["data_ptr"])
            key = str(share[1])
        except (KeyError, TypeError, ValueError, IndexError):
            raise TransferError(f"cuda_ipc: malformed peer endpoint {peer!r}") from None
        if peer.get("boot_id") != _boot_id():
            raise TransferError(f"cuda_ipc: {self.describe(peer)} is on another host")
        if peer.get("pid") == os.getpid() and remote in _EXPORTED:
            return remote, _EXPORTED[remote]  # a buffer of this process (a benchmark's loopback): no IPC
        with self._lock:
            if key not in self._peers:
                dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = share
                try:
                    storage = torch.UntypedStorage._new_shared_cuda(
                        int(dev), _unb64(handle), int(size), int(offset), _unb64(rc_handle), int(rc_offset),
                        _unb64(ev_handle), bool(ev_sync))
                except Exception as e:
                    raise TransferError(f"cuda_ipc: cannot map the memory of {self.describe(peer)} ({e}): is the "
                                        "process gone, or its GPU not visible here?") from None
                self._peers[key] = (remote, _bytes_view(storage))
            return self._peers[key]

    def _write(self, peer: dict[str, Any], src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Three kernels whatever the chunk count: gather the source chunks (rows of ``unit``
        bytes, the gcd of every length and offset) into a staging buffer, one peer copy of it to
        the peer's GPU, scatter there into the mapped peer memory."""
        if self._local is None:
            raise TransferError("cuda_ipc: nothing registered to write from")
        remote, dview = self._mapped(peer)
        lbase, sview = self._local
        so = np.asarray(src, dtype=np.int64) - lbase
        do = np.asarray(dst, dtype=np.int64) - remote
        n = np.asarray(lengths, dtype=np.int64)
        if (so < 0).any() or (do < 0).any() or (so + n > sview.numel()).any() or (do + n > dview.numel()).any():
            raise TransferError(f"cuda_ipc: a chunk is outside {self.describe(peer)}'s registered memory "
                                "(or its source outside ours)")
        unit = int(np.gcd.reduce(np.concatenate((n, so, do))))
        rows = n // unit
        starts = np.repeat(np.cumsum(rows) - rows, rows)
        step = np.arange(int(rows.sum())) - starts
        src_rows = torch.from_numpy(np.repeat(so // unit, rows) + step)
        dst_rows = torch.from_numpy(np.repeat(do // unit, rows) + step)
        stream = getattr(self._tls, "stream", None)
        if stream is None:
            stream = self._tls.stream = torch.cuda.Stream(self.device)
        # No wait on the compute stream: the caller hands over KV that is complete (a prefill server
        # parks a request only after reading its sampled token, computed after its KV). Waiting here
        # would put every transfer behind the forward pass in flight.
        try:
            with torch.cuda.stream(stream):
                sv = sview[: sview.numel() // unit * unit].view(-1, unit)
                dv = dview[: dview.numel() // unit * unit].view(-1, unit)
                staged = sv.index_select(0, src_rows.to(sv.device, non_blocking=True))
                if dv.device != sv.device:
                    with torch.cuda.device(dv.device):
                        staged = staged.to(dv.device)
                dv.index_copy_(0, dst_rows.to(dv.device), staged)
            stream.synchronize()
            torch.cuda.synchronize(dv.device)  # the scatter ran on the peer GPU's stream
        except Exception as e:
            raise TransferError(f"cuda_ipc: write to {self.describe(peer)} failed: {e}") from e

    def _close(self) -> None:
        with self._lock:
            self._peers.clear()
