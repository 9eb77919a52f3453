"""Pinning L2 in place registers the pool's own memory and nothing else.

A registered range that starts below the buffer covers other objects' bytes: CUDA then calls
them pinned, torch's ``pin_memory()`` hands such a tensor back as it is, and the non-blocking
copy that follows reads memory Python frees and reuses meanwhile (on the H200: batch indices
read after reuse, an illegal memory access in ``tests/cache/test_tier_concurrency.py``'s
layer-first GPU cases). The registration is recorded here on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from hicache.tiers import host_base as host_mod  # the pool registers its buffer there
from hicache.tiers.device import KVLayout
from hicache.tiers.host import HOLD_ENV, make_host_pool
from hicache.tiers.host_pinning import ALIGN, HostPinner

# the tiny model of the tier tests: 2 layers, 2 KV heads of 16, fp32, pages of 4 tokens
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)


def _ranges(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Records every range the pool registers (on a CUDA host it is still registered)."""
    got: list[tuple[int, int]] = []
    for name in ("no_register", "cuda_register"):
        register = getattr(host_mod, name)

        def record(ptr: int, size: int, register=register) -> None:
            got.append((ptr, ptr + size))
            register(ptr, size)
        monkeypatch.setattr(host_mod, name, record)
    return got


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("pages", [96, 700, 5000])
def test_a_pool_registers_only_its_own_whole_pages(monkeypatch, tmp_path, layout, pages):
    """Every registered byte is the pool's, every byte of the pool is registered, and the pool
    (its storage, not only a view) starts on an ALIGN boundary (no OS page it pins holds another
    object)."""
    got = _ranges(monkeypatch)
    monkeypatch.setenv(HOLD_ENV, str(tmp_path / "no-hold"))  # the CPU path of pinning in place, not held
    pool = make_host_pool(layout, LAYOUT, pages, 4)
    try:
        base = pool.buffer.data_ptr()
        end = base + pool.buffer.numel() * pool.buffer.element_size()
        assert base % ALIGN == 0
        # torch asks CUDA about a tensor's storage's first byte (Tensor.is_pinned, non-blocking copies,
        # the page-move kernel): the storage must start where the registered memory starts
        assert pool.buffer.untyped_storage().data_ptr() == base
        shown = (hex(base), hex(end), [(hex(a), hex(b)) for a, b in got])
        assert got and all(base <= a < b <= end for a, b in got), shown
        covered = sorted(got)
        assert covered[0][0] == base and covered[-1][1] == end
        assert all(b1 == a2 for (_, b1), (a2, _) in zip(covered, covered[1:], strict=False)), "a gap or an overlap"
    finally:
        pool.release()


@pytest.mark.parametrize("rows", [1, 4, 64])
def test_the_pinner_keeps_its_cuts_inside_any_buffer(rows):
    """Even for a buffer that does not start on an ALIGN boundary (a caller's own tensor)."""
    buf = torch.empty(rows * 96 * 128 + 3, dtype=torch.float32)[3:].view(rows, 96, 128)
    assert buf.data_ptr() % ALIGN != 0
    got: list[tuple[int, int]] = []
    pinner = HostPinner(buf, rows, 96, register=lambda ptr, size: got.append((ptr, ptr + size)),
                        unregister=lambda ptr: None)
    pinner.start(background=False)
    base, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * 4
    assert got and all(base <= a < b <= end for a, b in got), (hex(base), [(hex(a), hex(b)) for a, b in got])
    assert pinner.ready_pages() == 96
    pinner.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_a_pool_whose_every_layer_slides_pins_its_window_pool_only(monkeypatch, tmp_path, layout):
    """A model whose every layer slides (Mistral with a window) keeps no full-attention layer in L2's main
    buffer: zero bytes to pin there (it failed to allocate on the H200: ``count (0) must not be 0``); its
    window pool holds the KV, and every page is usable at once."""
    monkeypatch.setenv(HOLD_ENV, str(tmp_path / "no-hold"))  # the CPU path of pinning in place, not held
    pool = make_host_pool(layout, LAYOUT, 64, 4, window_layers=(0, 1), window_pages=16)
    try:
        assert pool.buffer.numel() == 0 and pool.windows is not None
        pages = pool.allocator.alloc(16)
        assert pages is not None and len(pages) == 16
        pool.check_integrity()
    finally:
        pool.release()
