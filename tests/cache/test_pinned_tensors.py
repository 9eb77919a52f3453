"""Pinned host tensors of the L2 state pool and the host window pool: exact sizes, unpinned on release.

torch's ``pin_memory=True`` goes through its caching host allocator, which rounds every allocation up
to a power of two and keeps it pinned after the tensor is freed. On the H200 host Qwen3.5's 28 GB L2
state pool (48 tensors of 1.15 GB) pinned 48 GiB, and the engine restarted beside the released one
was killed for memory. On the CPU the registration is recorded (``cuda_register`` replaced); on a
CUDA host the process's resident memory is measured around a real pool.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hicache.tiers import host_pinning
from hicache.tiers.device import KVLayout
from hicache.tiers.host import make_host_pool
from hicache.tiers.host_pinning import ALIGN
from hicache.tiers.host_state import HostStatePool
from hicache.tiers.state_layout import StateLayout, StateTensor

# 3 state layers, a recurrent state of 1.5 MiB (not a power of two) and a conv state of 96 KiB each
LAYOUT = StateLayout(tuple(
    (StateTensor("conv", (3, 8192), torch.float32), StateTensor("recurrent", (3, 128, 1024), torch.float32))
    for _ in range(3)))


def _record(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[int, int], list[int]]:
    registered: dict[int, int] = {}
    unregistered: list[int] = []
    monkeypatch.setattr(host_pinning, "cuda_register", lambda ptr, size: registered.__setitem__(ptr, size))
    monkeypatch.setattr(host_pinning, "cuda_unregister", unregistered.append)
    return registered, unregistered


def test_the_l2_state_pool_pins_each_tensor_at_its_own_size_and_unpins_on_release(monkeypatch):
    registered, unregistered = _record(monkeypatch)
    pool = HostStatePool(LAYOUT, 5, pin_memory=True)
    tensors = pool.tensors()
    assert len(tensors) == 6
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        assert registered[t.data_ptr()] == -(-nbytes // ALIGN) * ALIGN  # whole ALIGN blocks, no power of two
        assert t.data_ptr() % ALIGN == 0 and not t.any()
    assert len(registered) == 6
    pool.release()
    assert sorted(unregistered) == sorted(registered)
    pool.release()  # idempotent
    assert len(unregistered) == 6


def test_a_pool_dropped_without_release_still_unpins(monkeypatch):
    registered, unregistered = _record(monkeypatch)
    pool = HostStatePool(LAYOUT, 2, pin_memory=True)
    del pool
    gc.collect()
    assert sorted(unregistered) == sorted(registered) and len(registered) == 6


def test_the_host_window_pool_pins_its_own_buffer_and_unpins_with_the_pool(monkeypatch):
    from hicache.tiers import host_base

    registered, unregistered = _record(monkeypatch)
    main: list[int] = []
    monkeypatch.setattr(host_base, "cuda_register", lambda ptr, size: main.append(ptr))
    monkeypatch.setattr(host_base, "cuda_unregister", lambda ptr: None)
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    pool = make_host_pool("page_first", layout, 64, 4, pin_memory=True, window_layers=(0, 1, 2), window_pages=24)
    buf = pool.windows.buffer
    assert registered == {buf.data_ptr(): -(-buf.numel() * 4 // ALIGN) * ALIGN}
    assert main and buf.data_ptr() not in main
    pool.release()
    assert unregistered == [buf.data_ptr()]


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pins host memory for a CUDA device")
def test_a_released_pinned_state_pool_gives_its_memory_back():
    big = StateLayout(tuple((StateTensor("recurrent", (48, 128, 128), torch.float32),) for _ in range(4)))
    n = 96  # 4 tensors of 288 MiB (a power of two would be 512 MiB each)
    before = _rss()
    pool = HostStatePool(big, n, pin_memory=True)
    assert all(t.is_pinned() for t in pool.tensors())
    held = _rss() - before
    want = 4 * n * 48 * 128 * 128 * 4
    assert want * 0.95 <= held <= want * 1.1, (held, want)
    pool.release()
    del pool
    gc.collect()
    assert _rss() - before < want * 0.1
