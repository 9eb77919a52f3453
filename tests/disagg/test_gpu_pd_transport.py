"""cuda_ipc KV transport between two processes on two GPUs of one host (skipped elsewhere):
scattered chunks written by the process on cuda:0 land byte-exact in the buffer of the process
on cuda:1; a chunk outside the peer's memory is a TransferError."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs of one host")
NBYTES = 8 << 20
CHUNK = 4096


def _receiver(conn) -> None:  # noqa: ANN001 - a multiprocessing Connection
    from serving.disagg.transport import make_transport
    from serving.disagg.transport_base import TransportConfig

    torch.cuda.set_device(1)
    buf = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda:1")
    t = make_transport("cuda_ipc", TransportConfig())
    t.register_tensor(buf)
    conn.send((t.endpoint(), buf.data_ptr()))
    conn.recv()  # the sender wrote
    conn.send(buf.cpu().numpy().tobytes())
    conn.recv()


def test_cuda_ipc_scattered_write_is_exact() -> None:
    from serving.disagg.transport import make_transport
    from serving.disagg.transport_base import TransferError, TransportConfig

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(b,))
    proc.start()
    try:
        peer, dbase = a.recv()
        torch.cuda.set_device(0)
        src = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device="cuda:0")
        t = make_transport("cuda_ipc", TransportConfig())
        t.register_tensor(src)
        n = NBYTES // CHUNK
        perm = torch.randperm(n).tolist()
        t.write(peer, [src.data_ptr() + i * CHUNK for i in range(n)], [dbase + perm[i] * CHUNK for i in range(n)],
                [CHUNK] * n)
        a.send("written")
        got = torch.frombuffer(bytearray(a.recv()), dtype=torch.uint8).view(n, CHUNK)
        want = torch.empty_like(got)
        want[torch.tensor(perm)] = src.cpu().view(n, CHUNK)
        assert torch.equal(got, want)
        a.send("done")
        proc.join(30)
        with pytest.raises(TransferError):  # outside the peer's registered memory: refused, nothing written
            t.write(peer, [src.data_ptr()], [dbase + NBYTES - CHUNK // 2], [CHUNK])
    finally:
        if proc.is_alive():
            proc.kill()
