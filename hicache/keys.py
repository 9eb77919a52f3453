"""Page keys for the storage tier (L3): a hash chain over full token pages, namespaced.

A page's key is ``H(namespace, key of the previous page, the page's token ids)`` with
``H`` = BLAKE2b-128, written as 32 lowercase hex characters. So:

- equal keys mean equal token prefixes under the same namespace, hence equal KV for the
  same model / layout / tensor-parallel rank / cache_salt;
- the keys of a prefix are a prefix of the keys (``page_keys(t[:k*ps]) ==
  page_keys(t)[:k]``), and a chain can be continued from a known key with
  ``parent_key`` (``page_keys(a + b) == ka + page_keys(b, parent_key=ka[-1])`` when ``a``
  is page-aligned).

Token ids are hashed as little-endian int64, so ids of any vocabulary size are exact.
Pure functions; thread-safe.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any

KEY_HEX_LEN = 32  # BLAKE2b-128
_SEP = b"\x1f"


def _layout_desc(layout: Any) -> str:
    # A KVLayout (duck-typed so this module imports nothing heavy) or any string.
    if isinstance(layout, str):
        return layout
    dtype = str(layout.dtype).removeprefix("torch.")
    fmt = getattr(layout, "format", "mha")  # MLA's latent pages: never another layout's
    return f"L{layout.num_layers}.H{layout.num_kv_heads}.D{layout.head_dim}.{dtype}" + \
        ("" if fmt == "mha" else f".{fmt}")


def namespace_for(
    model_id: str,
    layout_desc: Any,
    tp_rank: int = 0,
    cache_salt: str | None = None,
    page_size: int | None = None,
) -> str:
    """The namespace of a model's pages: ``model|layout|tp<rank>[|ps<n>][|salt:<digest>]``.

    ``layout_desc``: a string, or a :class:`hicache.tiers.device.KVLayout` (layers, kv
    heads, head dim, dtype; an MLA layout adds ``.mla``). ``cache_salt`` isolates tenants: it is hashed, never stored
    in clear. The page size is optional (keys of different page sizes never coincide
    anyway since the hashed token runs differ in length) but makes stores easier to
    tell apart. Raises ``ValueError`` on an empty model id or a negative rank.
    """
    if not model_id:
        raise ValueError("model_id must not be empty")
    if tp_rank < 0:
        raise ValueError(f"tp_rank must be >= 0, got {tp_rank}")
    parts = [model_id, _layout_desc(layout_desc), f"tp{tp_rank}"]
    if page_size is not None:
        parts.append(f"ps{page_size}")
    if cache_salt is not None:
        parts.append("salt:" + hashlib.blake2b(cache_salt.encode(), digest_size=8).hexdigest())
    return "|".join(parts)


def page_keys(
    tokens: Sequence[int], page_size: int, namespace: str, parent_key: str | None = None
) -> list[str]:
    """Keys of the full pages of ``tokens`` (a trailing partial page gets none).

    ``parent_key``: key of the page just before ``tokens[0]`` (``None`` at the start of a
    sequence). Raises ``ValueError`` for a non-positive page size, an empty namespace or a
    malformed parent key.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if not namespace:
        raise ValueError("namespace must not be empty")
    prev = b"" if parent_key is None else _parse_key(parent_key)
    base = hashlib.blake2b(digest_size=16, person=b"hicache-page")
    base.update(namespace.encode())
    base.update(_SEP)
    n = len(tokens) // page_size
    tokens = list(tokens[: n * page_size])
    out = []
    fmt = f"<{page_size}q"
    for i in range(n):
        h = base.copy()
        h.update(prev)
        h.update(_SEP)
        h.update(struct.pack(fmt, *tokens[i * page_size : (i + 1) * page_size]))
        prev = h.digest()
        out.append(prev.hex())
    return out


def _parse_key(key: str) -> bytes:
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    if len(raw) * 2 != KEY_HEX_LEN:
        raise ValueError(f"not a page key: {key!r}")
    return raw


def tp_shard_key(key: str, kv_head_start: int, num_kv_heads: int) -> str:
    """The L3 key of one tensor-parallel rank's part of a page whose rank-0 key is ``key``.

    A rank's part is its kv heads ``[kv_head_start, kv_head_start + num_kv_heads)``; the part
    holding head 0 (rank 0's, and any rank replicating head 0) is stored under ``key`` itself,
    every other part under ``H(key, "kv<start>+<n>")``. Ranks that replicate the same heads
    write the same value under the same key; a page is in L3 only when every part is.
    """
    if kv_head_start == 0:
        return key
    h = hashlib.blake2b(_parse_key(key), digest_size=16, person=b"hicache-tp")
    h.update(f"kv{kv_head_start}+{num_kv_heads}".encode())
    return h.hexdigest()


COMPONENTS = ("state",)  # what besides a page's KV is stored under a key derived from it


def component_key(key: str, component: str) -> str:
    """The L3 key of ``component`` stored at the page whose key is ``key``: ``H(key, component)``.

    ``"state"``: the recurrent-state snapshot after the page's last token (a model with state
    layers), under its node's last page key. Distinct from every page key and tensor-parallel
    shard key (a differently personalised hash), and like them a function of the prefix, the
    namespace (model, layout, rank, salt) and the component alone; raises ``ValueError`` on a
    malformed key or an unknown component.
    """
    if component not in COMPONENTS:
        raise ValueError(f"unknown cache component {component!r}; choose from {COMPONENTS}")
    h = hashlib.blake2b(_parse_key(key), digest_size=16, person=b"hicache-comp")
    h.update(component.encode())
    return h.hexdigest()


def state_key(key: str) -> str:
    """The L3 key of the state snapshot at the page whose key is ``key`` (:func:`component_key`)."""
    return component_key(key, "state")
