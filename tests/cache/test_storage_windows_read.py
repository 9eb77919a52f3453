"""L3 reads into an L2 with a host window pool (hicache/tiers/storage_windows.py) over LMDB: short values (no
sliding part) copied and hashed straight into their L2 pages in one call per group, whole values (a kept
sliding part) in another (full rows into the L2 page, sliding rows into a host window page), both checked
against their trailers; a corrupt value in the middle
ends the read there and is deleted. Every L2 layout and thread count gives the stored bytes back."""

from __future__ import annotations

import pytest
import torch

from harness.lmdb_pages import PS, keys_for, open_store
from hicache.tiers.device import KVLayout
from hicache.tiers.host import make_host_pool
from hicache.tiers.page_codec import TRAILER_SIZE
from hicache.tiers.storage import StorageTier
from hicache.tiers.storage_windows import reads_direct

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)  # layers 0, 1 slide
WINDOWS = dict(window_layers=(0, 1), window_pages=16)


def _source(n: int, whole: list[int]):
    src = make_host_pool("page_first", LAYOUT, n, PS, **WINDOWS)
    pages = src.allocator.alloc(n)
    src.windows.take([pages[i] for i in whole])
    g = torch.Generator().manual_seed(5)
    src.write_pages(torch.tensor(pages), torch.randn((6, n, src.row_elems), generator=g).to(LAYOUT.dtype))
    return src, pages


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("threads", [1, 3])
def test_short_and_whole_values_land_and_a_corrupt_one_ends_the_read(tmp_path, layout, threads):
    n, whole = 24, [3, 4, 5, 17, 18]  # the pages whose sliding part was kept (sequence ends' last windows)
    src, pages = _source(n, whole)
    store = open_store(tmp_path / "db", capacity_gb=0.05, initial_map_mb=1)
    tier = StorageTier(store, LAYOUT, PS, read_threads=threads)
    keys = keys_for(n, salt=9)
    assert tier.batch_set(keys, src, pages) == n
    bad = 20  # a short value after the second run of whole ones
    sizes = [len(store.get(k)) for k in keys[:bad]]
    assert len(set(sizes)) == 2  # whole and short values
    raw = bytearray(store.get(keys[bad]))
    raw[len(raw) // 2] ^= 0x01
    assert store.set(keys[bad], bytes(raw))
    dst = make_host_pool(layout, LAYOUT, n + 8, PS, **WINDOWS)
    assert reads_direct(dst, tier.codec, store) == (layout == "page_first")
    into = dst.allocator.alloc(n)
    assert tier.start_read(keys, dst, into).result() == bad
    got = dst.read_pages(torch.tensor(into[:bad]))
    want = src.read_pages(torch.tensor(pages[:bad]))
    assert torch.equal(got, want)  # the full layers everywhere, the sliding rows of the whole pages
    assert [i for i in range(bad) if dst.windows.has(into[i])] == [i for i in whole if i < bad]
    st = tier.stats()
    assert st["corrupt"] == 1 and st["hits"] == bad
    assert st["bytes_read"] == sum(sizes)  # what was read: a short value is smaller than a whole one
    assert tier.batch_exists(keys[bad:]) == 0  # the corrupt value was deleted
    tier.close()


def test_both_l2_layouts_store_the_same_values(tmp_path):
    """A page with a host window page is stored whole (every layer in device order), one without it short
    (its full layers only, flagged): the same bytes from a ``page_first`` and a ``layer_first`` L2, each
    page read where it lies (hicache.tiers.storage_windows.frame)."""
    n, whole = 12, [2, 7, 8]
    g = torch.Generator().manual_seed(11)
    row = PS * LAYOUT.num_kv_heads * LAYOUT.head_dim  # elements of one layer's K (or V) of a page
    kv = torch.randn((6, n, row), generator=g).to(LAYOUT.dtype)
    values = {}
    for layout in ("page_first", "layer_first"):
        src = make_host_pool(layout, LAYOUT, n, PS, **WINDOWS)
        pages = src.allocator.alloc(n)
        src.windows.take([pages[i] for i in whole])
        src.write_pages(torch.tensor(pages), kv)
        store = open_store(tmp_path / layout, capacity_gb=0.05, initial_map_mb=1)
        tier = StorageTier(store, LAYOUT, PS)
        keys = keys_for(n, salt=4)
        assert tier.batch_set(keys, src, pages) == n
        values[layout] = [store.get(k) for k in keys]
        tier.close()
    assert values["page_first"] == values["layer_first"]
    for i, v in enumerate(values["page_first"]):
        payload = torch.frombuffer(bytearray(v[:len(v) - TRAILER_SIZE]), dtype=LAYOUT.dtype).view(-1, row)
        if i in whole:  # K of layers 0, 1, 2, then V of each
            assert torch.equal(payload, kv[:, i])
        else:  # K then V of layer 2 alone
            assert payload.shape[0] == 2 and torch.equal(payload, kv[[2, 5], i])


@pytest.mark.parametrize("threads", [1, 3])
def test_a_corrupt_whole_value_ends_the_read_and_holds_no_window_page(tmp_path, threads):
    """Whole values are copied (full rows into the L2 page, sliding rows into a host window page) before their
    hashes are checked: the corrupt one, and every whole value read after it, give their window pages back."""
    n, whole = 24, [3, 4, 5, 9, 10, 17, 18]
    src, pages = _source(n, whole)
    store = open_store(tmp_path / "db", capacity_gb=0.05, initial_map_mb=1)
    tier = StorageTier(store, LAYOUT, PS, read_threads=threads)
    keys = keys_for(n, salt=12)
    assert tier.batch_set(keys, src, pages) == n
    bad = 9  # a whole value, with whole ones after it in the same read
    raw = bytearray(store.get(keys[bad]))
    raw[len(raw) // 3] ^= 0x01
    assert store.set(keys[bad], bytes(raw))
    dst = make_host_pool("page_first", LAYOUT, n + 8, PS, **WINDOWS)
    into = dst.allocator.alloc(n)
    assert tier.start_read(keys, dst, into).result() == bad
    assert torch.equal(dst.read_pages(torch.tensor(into[:bad])), src.read_pages(torch.tensor(pages[:bad])))
    assert [i for i in range(n) if dst.windows.has(into[i])] == [3, 4, 5]
    assert dst.windows.num_free == WINDOWS["window_pages"] - 3
    tier.close()


def test_whole_values_beyond_the_free_window_pages_land_without_their_sliding_part(tmp_path):
    n, whole = 12, [1, 2, 3, 4, 5, 6]
    src, pages = _source(n, whole)
    store = open_store(tmp_path / "db", capacity_gb=0.05, initial_map_mb=1)
    tier = StorageTier(store, LAYOUT, PS, read_threads=1)
    keys = keys_for(n, salt=13)
    assert tier.batch_set(keys, src, pages) == n
    dst = make_host_pool("page_first", LAYOUT, n + 8, PS, window_layers=(0, 1), window_pages=4)
    into = dst.allocator.alloc(n)
    assert tier.start_read(keys, dst, into).result() == n
    kept = [i for i in range(n) if dst.windows.has(into[i])]
    assert len(kept) == 4 and set(kept) <= set(whole)
    got, want = dst.read_pages(torch.tensor(into)), src.read_pages(torch.tensor(pages))
    assert torch.equal(got[[2, 5]], want[[2, 5]])  # layer 2's K and V (full) everywhere
    assert torch.equal(got[:, kept], want[:, kept])  # and every layer where the window was kept
    tier.close()
