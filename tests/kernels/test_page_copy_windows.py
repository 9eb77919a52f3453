"""PageMover (serving/kernels/page_copy.py) over a hybrid SWA L1 (hicache/tiers/window_pages.py): a page's
full layers move from / to its logical page, its sliding layers from / to its window page where it has one
(the host page's ``sliding_valid`` says whether its sliding rows are good). Both paths: torch indexing
(CPU, here) and the Triton kernel path's launches (``PageMover.move``: one per run of host rows in one
buffer, layered loads per group of layers with a capped program count) under Triton's interpreter, in a
child process. On the GPU, the kernel path runs for real in tests/engine/test_gpu_windows.py's L2 case."""

from __future__ import annotations

import pytest
import torch

from harness.interpreted import run_interpreted
from hicache.tiers.device import DeviceKVPool, KVLayout
from hicache.tiers.host import make_host_pool
from serving.kernels.page_copy import PageMover

LAYERS, PS, HEADS, DIM = 5, 4, 2, 8
CASES = {"gemma3": (0, 1, 3), "mistral": tuple(range(LAYERS)), "none": ()}  # the window layers


def make_pool(window_layers: tuple[int, ...], seed: int = 0) -> DeviceKVPool:
    """12 logical pages, 6 window pages; logical pages 1, 4, 7 and 9 hold window pages 5, 0, 3 and 2."""
    pool = DeviceKVPool(KVLayout(LAYERS, HEADS, DIM, torch.float32), 12, PS, "cpu", window_layers, 6)
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g))
    if pool.windows is not None:
        pool.win_buffer.copy_(torch.randn(pool.win_buffer.shape, generator=g))
        pool.allocator.alloc(12)
        pool.windows.allocator.alloc(6)
        for p, w in ((1, 5), (4, 0), (7, 3), (9, 2)):
            pool.windows.map[p] = w
    return pool


def host_page(host, page: int) -> torch.Tensor:
    """``[2L, X]``: one host page, rows in the usual order (K of each KV layer, then V of each)."""
    return host.read_pages(torch.tensor([page]))[:, 0]


def expected_page(pool: DeviceKVPool, page: int) -> list[torch.Tensor | None]:
    """Per host row, what a backup of ``page`` writes there (None: a stale sliding row)."""
    rows: list[torch.Tensor | None] = []
    for kv in (0, 1):
        for i in range(LAYERS):
            buf = pool.k_buffers[i] if kv == 0 else pool.v_buffers[i]
            if i in pool.window_layers:
                w = pool.windows.map[page]
                rows.append(None if w < 0 else buf[w].flatten())
            else:
                rows.append(buf[page].flatten())
    return rows


@pytest.mark.parametrize("layout_name", ["layer_first", "page_first"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_backup_and_load_move_window_pages(case: str, layout_name: str) -> None:
    pool = make_pool(CASES[case])
    host = make_host_pool(layout_name, pool.layout, 8, PS, pin_memory=False)
    mover = PageMover(pool, host)
    assert not mover.use_kernel
    src, dst = [7, 2, 9, 1, 4], [6, 0, 3, 1, 5]  # pages 2 has no window page
    mover.device_to_host(src, dst)
    for p, hp in zip(src, dst, strict=True):
        got = host_page(host, hp)
        want = expected_page(pool, p)
        for r, row in enumerate(want):
            if row is not None:
                assert torch.equal(got[r], row), (p, r)
        if pool.windows is not None:
            assert host.sliding_valid[hp] == (1 if pool.windows.map[p] >= 0 else 0)
    # load back into another pool: pages 3, 5 and 8 with window pages (4, 1, 0), page 10 without
    back = make_pool(CASES[case], seed=1)
    if back.windows is not None:
        back.windows.map[:] = [-1] * 12
        for p, w in ((3, 4), (5, 1), (8, 0)):
            back.windows.map[p] = w
    before = back.win_buffer.clone() if back.win_buffer is not None else None
    PageMover(back, host).host_to_device([6, 3, 1, 5], [3, 5, 8, 10])
    for hp, p in zip([6, 3, 1, 5], [3, 5, 8, 10], strict=True):
        got = expected_page(back, p)
        want = host_page(host, hp)
        for r, row in enumerate(got):
            if row is not None:
                assert torch.equal(row, want[r]), (p, r)
    if before is not None:  # window pages of no loaded page are untouched
        for w in (2, 3, 5):
            assert torch.equal(back.win_buffer[:, :, w], before[:, :, w])


def test_a_pool_buffer_moves_as_before() -> None:
    """A plain pool buffer (no window pool): every layer from / to its page, the host flags untouched."""
    pool = make_pool(())
    host = make_host_pool("layer_first", pool.layout, 8, PS, pin_memory=False)
    host.sliding_valid[2] = 0
    PageMover(pool.kv_buffer, host).device_to_host([4, 5], [2, 3])
    assert torch.equal(host.buffer[:, 2], pool.kv_buffer.view(2 * LAYERS, 12, -1)[:, 4])
    assert host.sliding_valid[2] == 0


KERNEL_CODE = """
import torch
from hicache.tiers.host import make_host_pool
from serving.kernels.page_copy import LAYER_GROUP, PageMover
from tests.kernels.test_page_copy_windows import CASES, LAYERS, PS, make_pool
for case, layers in sorted(CASES.items()):
    for name in ("layer_first", "page_first"):
        pool = make_pool(layers)
        staged = make_host_pool(name, pool.layout, 8, PS, pin_memory=False)
        kernel = make_host_pool(name, pool.layout, 8, PS, pin_memory=False)
        src, dst = [7, 2, 9, 1, 4], [6, 0, 3, 1, 5]
        PageMover(pool, staged).device_to_host(src, dst)           # torch indexing
        mover = PageMover(pool, kernel)
        assert not mover.use_kernel
        d, h = mover.id_lists(src, dst)
        ids = torch.tensor([d, h])
        n = len(src)
        runs = mover._runs(0, 2 * LAYERS)
        assert len(runs) == {"gemma3": 8, "mistral": 1, "none": 1}[case], runs
        mover.move(True, (ids[0, :n], ids[1, :n], ids[0, n:], ids[1, n:]), [(0, 2 * LAYERS)])  # the kernels
        for hp, p in zip(dst, src):
            rows = torch.ones(2 * LAYERS, dtype=torch.bool)
            if pool.windows is not None and pool.windows.map[p] < 0:
                rows[[kv * LAYERS + i for kv in (0, 1) for i in pool.window_layers]] = False
            a = staged.read_pages(torch.tensor([hp]))[:, 0]
            b = kernel.read_pages(torch.tensor([hp]))[:, 0]
            assert torch.equal(a[rows], b[rows]), (case, name, p)
        # loads: whole, then layered (groups of LAYER_GROUP layers, K rows then V rows, capped programs)
        for layered in (False, True):
            back_s, back_k = make_pool(layers, seed=1), make_pool(layers, seed=1)
            for b in (back_s, back_k):
                if b.windows is not None:
                    b.windows.map[:] = [-1] * 12
                    for p, w in ((3, 4), (5, 1), (8, 0)):
                        b.windows.map[p] = w
            hs, ps_ = [6, 3, 1, 5], [3, 5, 8, 10]
            PageMover(back_s, staged).host_to_device(hs, ps_)
            mk = PageMover(back_k, staged)
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
            if back_s.win_buffer is not None:
                assert torch.equal(back_s.win_buffer, back_k.win_buffer), (case, name, layered)
        if not layers:
            continue
        # a window-only load (full=False): the sliding rows into the window pages, the full layers untouched
        back_s, back_k = make_pool(layers, seed=2), make_pool(layers, seed=2)
        for b in (back_s, back_k):
            b.windows.map[:] = [-1] * 12
            for p, w in ((3, 4), (5, 1), (8, 0)):
                b.windows.map[p] = w
        full_before = back_s.kv_buffer.clone()
        PageMover(back_s, staged).host_to_device(hs, ps_, full=False)
        assert torch.equal(back_s.kv_buffer, full_before), (case, name)
        mk = PageMover(back_k, staged)
        d, h = mk.id_lists(ps_, hs)
        ids = torch.tensor([d, h])
        none = ids[0, :0]
        mk.move(False, (none, none, ids[0, n:], ids[1, n:]), [(0, 2 * LAYERS)])
        assert torch.equal(back_k.kv_buffer, full_before), (case, name)
        assert torch.equal(back_s.win_buffer, back_k.win_buffer), (case, name)
        assert not torch.equal(back_s.win_buffer, make_pool(layers, seed=2).win_buffer), (case, name)
print("OK")
"""


def test_kernel_path_in_interpreter() -> None:
    """The kernel path's launches (backup, load, layered load) equal the torch path's, every host layout,
    a pool with sliding and full layers interleaved, one of sliding layers only, and one without windows."""
    pytest.importorskip("triton")
    run_interpreted(KERNEL_CODE)
