"""Cache salts: a per-request ``cache_salt`` partitions every tier of the cache.

A salted sequence is keyed in the cache by its token ids with the first ``SALTED_TOKENS``
of them rewritten into salt-specific negative ids (:func:`apply`). Everything that keys
on token ids then partitions by salt with no further code:

- the HiRadixTree's root children are keyed by the first page, so two salts never share a
  node (matching, insertion, eviction accounting and ``check_integrity`` all see it);
- L3 page keys hash the tokens as a chain from the first page, so every key differs;
- cache events carry those keys, and a router that salts the same way sees the partition.

The model never sees salted ids: it reads the raw ids (``Req.model_ids``). Rewritten ids
are ``-(h << 32) - 1 - t`` with ``h`` in ``[2**30, 2**31)`` (30 bits of a BLAKE2b digest of
the salt per position, 120 bits for the 4 positions), so they fit an int64, are distinct
from the scheduler's small negative placeholders, and the raw id ``t`` (< 2**32) is kept.
Two different salts share a cached page only if 120 bits of their digests collide.
``salt=None`` (the default tenant) changes nothing: unsalted requests behave as before.

Pure functions; thread-safe.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

SALTED_TOKENS = 4
_SHIFT = 32
_TOKEN_LIMIT = 1 << _SHIFT
MAX_SALT_CHARS = 256


def salt_error(salt: object) -> str | None:
    """What is wrong with a request's ``cache_salt`` (None: fine, or no salt): the one rule the
    HTTP routes (a 400) and the engine (an invalid request) both apply."""
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_SALT_CHARS):
        return f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} characters"
    return None


def salt_tags(salt: str | None) -> tuple[int, ...]:
    """The per-position tags of ``salt`` (empty for None: unsalted)."""
    if salt is None:
        return ()
    digest = hashlib.blake2b(salt.encode(), digest_size=16, person=b"hicache-salt").digest()
    out = []
    for i in range(SALTED_TOKENS):
        chunk = int.from_bytes(digest[4 * i: 4 * i + 4], "little") & ((1 << 30) - 1)
        out.append(chunk | (1 << 30))
    return tuple(out)


def apply(tokens: Sequence[int], tags: tuple[int, ...]) -> list[int]:
    """``tokens`` as the cache keys them under ``tags`` (a new list; a copy when unsalted)."""
    out = list(tokens)
    for i, h in enumerate(tags[: len(out)]):
        t = out[i]
        if 0 <= t < _TOKEN_LIMIT:
            out[i] = -(h << _SHIFT) - 1 - t
    return out


def strip(tokens: Sequence[int]) -> list[int]:
    """The raw ids of salted ``tokens`` (inverse of :func:`apply`; unsalted ids pass through)."""
    out = list(tokens)
    for i in range(min(SALTED_TOKENS, len(out))):
        t = out[i]
        if t < -_TOKEN_LIMIT:
            out[i] = (-t - 1) % _TOKEN_LIMIT
    return out


def salt_of(tokens: Sequence[int]) -> tuple[int, ...] | None:
    """The tags a salted sequence carries (None when its first token is not salted)."""
    if not tokens or tokens[0] >= -_TOKEN_LIMIT:
        return None
    return tuple((-t - 1) >> _SHIFT for t in tokens[:SALTED_TOKENS] if t < -_TOKEN_LIMIT)


def combine(tenant: str | None, request_salt: str | None) -> str | None:
    """The effective salt of a request: its tenant's space, subdivided by its own ``cache_salt``.

    Length-prefixed, so no (tenant, salt) pair can produce another pair's salt: a request
    cannot reach another tenant's space by choosing its ``cache_salt``. None when both are
    None (the default tenant, unsalted)."""
    if tenant is None and request_salt is None:
        return None
    t = "" if tenant is None else tenant
    s = "" if request_salt is None else request_salt
    return f"{len(t)}:{t}|{int(tenant is not None)}{int(request_salt is not None)}|{s}"
