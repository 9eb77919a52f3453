"""Page keys (hash chain, namespaces), the value header codec and the backend registry."""

from __future__ import annotations

import re

import pytest
import torch

from hicache.keys import KEY_HEX_LEN, namespace_for, page_keys
from hicache.tiers.device import KVLayout
from hicache.tiers.storage import STORAGE_BACKENDS, TRAILER_SIZE, PageCodec, make_storage

LAYOUT = KVLayout(2, 2, 8, torch.bfloat16)
NS = namespace_for("org/model", LAYOUT)


def test_keys_are_a_chain_and_prefix_closed():
    toks = list(range(40))
    keys = page_keys(toks, 8, NS)
    assert len(keys) == 5 and all(re.fullmatch(f"[0-9a-f]{{{KEY_HEX_LEN}}}", k) for k in keys), keys
    assert len(set(keys)) == 5
    assert page_keys(toks[:24], 8, NS) == keys[:3]
    assert page_keys(toks + [1, 2, 3], 8, NS) == keys  # a partial page gets no key
    assert page_keys(toks[:7], 8, NS) == []
    # continuing the chain from a known key
    assert page_keys(toks[16:], 8, NS, parent_key=keys[1]) == keys[2:]
    # a page's key depends on the whole prefix, not only on its tokens
    other = page_keys([99] * 8 + toks[8:16], 8, NS)
    assert other[1] != keys[1]
    # deterministic (no per-process hash seed)
    assert page_keys(toks, 8, NS) == keys


def test_namespaces_separate_models_layouts_ranks_and_salts():
    toks = list(range(16))
    spaces = [
        NS,
        namespace_for("org/other", LAYOUT),
        namespace_for("org/model", KVLayout(2, 2, 8, torch.float16)),
        namespace_for("org/model", LAYOUT, tp_rank=1),
        namespace_for("org/model", LAYOUT, cache_salt="tenant-a"),
        namespace_for("org/model", LAYOUT, cache_salt="tenant-b"),
        namespace_for("org/model", "custom-layout"),
    ]
    assert len(set(spaces)) == len(spaces)
    assert len({page_keys(toks, 8, ns)[0] for ns in spaces}) == len(spaces)
    assert "tenant-a" not in spaces[4]  # the salt is hashed
    assert namespace_for("org/model", LAYOUT) == NS
    assert page_keys(toks, 16, NS)[0] not in page_keys(toks, 8, NS)  # page sizes never collide
    with pytest.raises(ValueError):
        namespace_for("", LAYOUT)
    with pytest.raises(ValueError):
        page_keys(toks, 0, NS)
    with pytest.raises(ValueError):
        page_keys(toks, 8, NS, parent_key="not-a-key")


def test_codec_rejects_every_kind_of_damage():
    codec = PageCodec(LAYOUT, 4)
    key, other = page_keys(list(range(8)), 4, NS)
    payload = torch.randn(codec.page_nbytes // 2).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    value = codec.encode(key, payload)
    nb = codec.page_nbytes
    assert len(value) == nb + TRAILER_SIZE and codec.verify(value, key)
    assert value[:nb] == payload  # payload first: one copy into a page_first L2 page
    assert not codec.verify(value, other)  # stored under another key
    # payload (first, middle, last byte), then the trailer: magic, version, dtype, rows, page
    # size, payload size, checksum, key digest
    for pos in (0, nb // 2, nb - 1, nb, nb + 4, nb + 6, nb + 8, nb + 12, nb + 24, nb + 32, nb + 44):
        bad = bytearray(value)
        bad[pos] ^= 0x10
        assert not codec.verify(bytes(bad), key), pos
    assert not codec.verify(value[:-1], key)
    assert not PageCodec(KVLayout(2, 2, 8, torch.float16), 4).verify(value, key)  # dtype differs
    assert not PageCodec(KVLayout(1, 4, 8, torch.bfloat16), 4).verify(value, key)  # shape differs


def test_registry():
    assert set(STORAGE_BACKENDS) == {"lmdb", "mooncake"}
    with pytest.raises(ValueError, match="unknown storage backend"):
        make_storage("redis", {})
    with pytest.raises(ValueError, match="unknown lmdb storage options"):
        make_storage("lmdb", {"path": "/tmp/x", "capacity": 1})
    with pytest.raises(ValueError, match="needs a path"):
        make_storage("lmdb", {})
