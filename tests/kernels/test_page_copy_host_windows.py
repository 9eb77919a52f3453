"""PageMover (serving/kernels/page_copy.py) between a hybrid SWA L1 and an L2 with a host window pool
(hicache/tiers/host_windows.py): a page's full layers move from / to its host page, its sliding layers from /
to its host window page; a backup gives a host window page to each page with an L1 window page while any is
free (the rest keep no sliding part). Both paths: torch indexing (CPU) and the Triton kernel path's launches
under Triton's interpreter, in a child process."""

from __future__ import annotations

import pytest
import torch

from harness.interpreted import run_interpreted
from hicache.tiers.device import DeviceKVPool, KVLayout
from hicache.tiers.host import make_host_pool
from serving.kernels.page_copy import PageMover

LAYERS, PS, HEADS, DIM = 5, 4, 2, 8
CASES = {"gemma3": (0, 1, 3), "mistral": tuple(range(LAYERS))}  # the window layers


def make_pool(window_layers: tuple[int, ...], seed: int = 0, wins=((1, 5), (4, 0), (7, 3), (9, 2))) -> DeviceKVPool:
    """12 logical pages, 6 window pages; ``wins``: (logical page, window page)."""
    pool = DeviceKVPool(KVLayout(LAYERS, HEADS, DIM, torch.float32), 12, PS, "cpu", window_layers, 6)
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g))
    pool.win_buffer.copy_(torch.randn(pool.win_buffer.shape, generator=g))
    pool.allocator.alloc(12)
    pool.windows.allocator.alloc(6)
    for p, w in wins:
        pool.windows.map[p] = w
    return pool


def make_host(pool: DeviceKVPool, name: str):
    """8 host pages, all handed out, and 3 host window pages."""
    host = make_host_pool(name, pool.layout, 8, PS, pin_memory=False, window_layers=pool.window_layers,
                          window_pages=3)
    host.allocator.alloc(8)
    return host


def rows_of(pool: DeviceKVPool, page: int) -> list[torch.Tensor | None]:
    """Per host row (K of each layer, then V of each), the device's KV of ``page`` (None: no window page)."""
    out: list[torch.Tensor | None] = []
    for kv in (0, 1):
        for i in range(LAYERS):
            buf = pool.k_buffers[i] if kv == 0 else pool.v_buffers[i]
            w = pool.windows.map[page] if i in pool.window_layers else page
            out.append(None if w < 0 else buf[w].flatten())
    return out


@pytest.mark.parametrize("name", ["layer_first", "page_first"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sliding_parts_go_to_host_window_pages(case: str, name: str) -> None:
    pool = make_pool(CASES[case])
    host = make_host(pool, name)
    src, dst = [7, 2, 9, 1, 4], [6, 0, 3, 1, 5]  # page 2 has no window page; 4 of them do, 3 host window pages
    PageMover(pool, host).device_to_host(src, dst)
    hw = host.windows
    assert [hw.has(h) for h in dst] == [True, False, True, True, False] and hw.not_kept == 1
    assert host.buffer.numel() == 8 * 2 * (LAYERS - len(CASES[case])) * PS * HEADS * DIM  # full layers only
    for p, hp in zip(src, dst, strict=True):
        got = host.read_pages(torch.tensor([hp]))[:, 0]
        for r, row in enumerate(rows_of(pool, p)):
            sliding = r % LAYERS in pool.window_layers
            if row is not None and (not sliding or hw.has(hp)):
                assert torch.equal(got[r], row), (p, r)
            elif sliding:
                assert not got[r].any()  # no sliding part kept: zeros
    # load back: pages 3, 5, 8 with window pages (4, 1, 0); host page 5 (no host window page) into 10
    back = make_pool(CASES[case], seed=1, wins=((3, 4), (5, 1), (8, 0), (10, 2)))
    before = back.win_buffer.clone()
    PageMover(back, host).host_to_device([6, 3, 1, 5], [3, 5, 8, 10])
    for hp, p in zip([6, 3, 1, 5], [3, 5, 8, 10], strict=True):
        want = host.read_pages(torch.tensor([hp]))[:, 0]
        for r, row in enumerate(rows_of(back, p)):
            if row is not None and (r % LAYERS not in back.window_layers or hw.has(hp)):
                assert torch.equal(row, want[r]), (p, r)
    for w in (2, 3, 5):  # window pages of no loaded page with a host window page are untouched
        assert torch.equal(back.win_buffer[:, :, w], before[:, :, w])
    host.allocator.free([6, 3])  # freeing host pages frees their host window pages
    assert hw.num_free == 2
    host.check_integrity()


KERNEL_CODE = """
import torch
from serving.kernels.page_copy import LAYER_GROUP, PageMover
from tests.kernels.test_page_copy_host_windows import CASES, LAYERS, make_host, make_pool
for case, layers in sorted(CASES.items()):
    for name in ("layer_first", "page_first"):
        pool = make_pool(layers)
        staged, kernel = make_host(pool, name), make_host(pool, name)
        src, dst = [7, 2, 9, 1, 4], [6, 0, 3, 1, 5]
        PageMover(pool, staged).device_to_host(src, dst)           # torch indexing
        mover = PageMover(pool, kernel)
        kernel.windows.take([h for p, h in zip(src, dst) if pool.windows.map[p] >= 0])  # as device_to_host does
        d, h = mover.id_lists(src, dst)
        ids = torch.tensor([d, h])
        n = len(src)
        runs = mover._runs(0, 2 * LAYERS)  # one launch per buffer: its rows lie in the host in its own order
        assert len(runs) == {"gemma3": 2, "mistral": 1}[case], runs
        mover.move(True, (ids[0, :n], ids[1, :n], ids[0, n:], ids[1, n:]), [(0, 2 * LAYERS)])  # the kernels
        assert staged.windows.map == kernel.windows.map
        assert torch.equal(staged.buffer, kernel.buffer) and torch.equal(staged.windows.buffer, kernel.windows.buffer)
        for layered in (False, True):
            wins = ((3, 4), (5, 1), (8, 0), (10, 2))
            back_s, back_k = make_pool(layers, seed=1, wins=wins), make_pool(layers, seed=1, wins=wins)
            hs, ps_ = [6, 3, 1, 5], [3, 5, 8, 10]
            PageMover(back_s, staged).host_to_device(hs, ps_)
            mk = PageMover(back_k, kernel)
            d, h = mk.id_lists(ps_, hs)
            ids = torch.tensor([d, h])
            n = len(ps_)
            four = (ids[0, :n], ids[1, :n], ids[0, n:], ids[1, n:])
            if not layered:
                mk.move(False, four, [(0, 2 * LAYERS)])
            else:
                for lo in range(0, LAYERS, LAYER_GROUP):
                    hi = min(LAYERS, lo + LAYER_GROUP)
                    mk.move(False, four, [(lo, hi), (LAYERS + lo, LAYERS + hi)], max_programs=3)
            assert torch.equal(back_s.kv_buffer, back_k.kv_buffer), (case, name, layered)
            assert torch.equal(back_s.win_buffer, back_k.win_buffer), (case, name, layered)
print("OK")
"""


def test_kernel_path_in_interpreter() -> None:
    """The kernel path's launches (backup, load, layered load) equal the torch path's with a host window pool,
    both host layouts, sliding and full layers interleaved and sliding layers only; a whole move is one launch
    per L1 buffer."""
    pytest.importorskip("triton")
    run_interpreted(KERNEL_CODE)
