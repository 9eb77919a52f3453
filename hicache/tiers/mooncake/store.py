"""Mooncake Store backend of the storage tier (distributed; for many serving nodes).

Uses ``mooncake.store.MooncakeDistributedStore`` (pip ``mooncake-transfer-engine-non-cuda``
on CPU machines, which needs Debian's ``libibverbs1 ibverbs-providers``; the CUDA build
``mooncake-transfer-engine`` on GPU machines) over TCP (or RDMA via ``protocol``/``device_name``).

Calls used:
- data path, zero-copy from/into the tier's staging buffers, registered once per buffer
  and client with ``register_buffer``: ``batch_put_from`` (set), ``batch_get_into`` (get),
  ``batch_is_exist`` (exists);
- bytes path (single-key API and tools): ``put`` / ``get`` / ``put_batch`` / ``get_batch``;
- ``batch_remove(force=True)`` / ``remove_by_regex(^prefix, force=True)``: delete / clear
  (force, because a key read recently is leased and a plain remove fails with -706);
- ``health_check`` for reconnect probes.

Semantics to keep in mind (see /work/shared/MOONCAKE.md): values live in the segments
the clients mount (``global_segment_mb`` from this one; the master picks the segment,
not necessarily the writer's): values go away with the client whose segment holds them,
the master evicts silently near its high watermark, and a restarted master knows
nothing -- the store is a cache, never the only copy. ``put`` on an existing key
keeps the old value (equal keys mean equal values; corrupt values are deleted by the
tier before a rewrite). Errors are return codes; a missing key reads as ``b''``.

Faults: every call runs on one of this backend's two I/O lanes (threads; the data calls
release the GIL): reads on one, writes and removals on the other, so a read never waits for
a write-back's transfer. A call is waited for at most
``timeout_s``. A failed or timed-out call counts an error, marks the backend down and
returns misses / ``False``; while down, calls return at once (counted ``unavailable``)
and a background thread probes the master (``health_check``) with exponential backoff
(``backoff_s`` .. ``max_backoff_s``), rebuilding the client (a fresh ``setup``, tried
only once the master answers a TCP probe: ``setup`` holds the GIL for ~1 s, ~90 s when
the master is dead) when it was never set up, when a call is stuck, or after
``resetup_after`` failed probes. A
timed-out transfer keeps its :class:`StagingBuffer` marked busy until it really ends, so
it can never write into memory reused meanwhile. Nothing raises into the serving path;
only the constructor raises (``ImportError`` without the package, ``ValueError`` for bad
options) -- a master that is down at construction is not an error (the backend starts down).

Thread-safety: any number of threads may call; reads are serialised on the read lane, writes
on the write lane.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hicache.tiers.base import ERROR, MISSING, TOO_LARGE, Buffer, StagingBuffer, StorageBackend, same_len
from hicache.tiers.mooncake.config import MooncakeConfig
from hicache.tiers.mooncake.connection import MooncakeConnection

# Return codes of the Mooncake client that are answers, not failures.
OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600


class MooncakeStore(StorageBackend):
    """The Mooncake backend (calls used and fault model in the module docstring): maps the
    backend API onto the client's calls and their return codes. ``store_factory`` (tests,
    tools) builds the client object.

    Threads: any number of callers at once; it keeps no state of its own besides the key
    prefix. ``conn`` (:class:`MooncakeConnection`) owns the client, its I/O lanes, health,
    reconnects and counters, and states which lock guards what.
    """

    name = "mooncake"

    def __init__(self, config: MooncakeConfig, store_factory: Callable[[], Any] | None = None) -> None:
        if store_factory is None:
            try:
                from mooncake.store import MooncakeDistributedStore
            except ImportError as e:
                raise ImportError(
                    "the mooncake storage backend needs `pip install mooncake-transfer-engine-non-cuda` "
                    "(CPU; plus `apt-get install -y libibverbs1 ibverbs-providers`) or "
                    "`mooncake-transfer-engine` (CUDA)"
                ) from e
            store_factory = MooncakeDistributedStore
        self.config = config
        self._prefix = config.key_prefix
        self.conn = MooncakeConnection(config, store_factory)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | MooncakeConfig) -> MooncakeStore:
        return cls(config if isinstance(config, MooncakeConfig) else MooncakeConfig.from_mapping(config))

    # ------------------------------------------------------------------ API
    @property
    def connected(self) -> bool:
        return self.conn.healthy

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str) -> bytes | None:
        return self.batch_get([key])[0]

    def set(self, key: str, value: Buffer) -> bool:
        return self.batch_set([key], [value])[0]

    def delete(self, key: str) -> bool:
        res = self.conn.call(lambda c: c.store.batch_remove([self._prefix + key], True), write=True)
        return bool(res) and res[0] == 0

    def clear(self) -> None:
        if self._prefix:
            pattern = "^" + re.escape(self._prefix)
            self.conn.call(lambda c: c.store.remove_by_regex(pattern, True), write=True)
        else:
            self.conn.call(lambda c: c.store.remove_all(True), write=True)

    def batch_exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        full = [self._prefix + k for k in keys]
        res = self.conn.call(lambda c: c.store.batch_is_exist(full))
        if res is None:
            return 0
        n = 0
        for r in res:
            if r != 1:
                if r < 0:
                    self.conn.failed()
                break
            n += 1
        return n

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        full = [self._prefix + k for k in keys]
        res = self.conn.call(lambda c: c.store.get_batch(full))
        if res is None or len(res) != len(keys):
            return [None] * len(keys)
        return [bytes(v) if len(v) else None for v in res]

    def batch_set(self, keys: Sequence[str], values: Sequence[Buffer]) -> list[bool]:
        same_len(keys, values)
        if not keys:
            return []
        full = [self._prefix + k for k in keys]
        vals = [memoryview(v).cast("B") for v in values]
        res = self.conn.call(lambda c: [c.store.put(k, v) for k, v in zip(full, vals, strict=True)], write=True)
        return self._set_results(res, len(keys))

    def _zero_copy_args(
        self, keys: Sequence[str], buf: StagingBuffer, spans: Sequence[tuple[int, int]]
    ) -> tuple[list[str], list[int], list[int]]:
        """Full keys, pointers into the registered staging buffer, and sizes, checked."""
        same_len(keys, spans)
        self._check_spans(buf, spans)
        return [self._prefix + k for k in keys], [buf.ptr + off for off, _ in spans], [n for _, n in spans]

    def batch_get_into(
        self, keys: Sequence[str], buf: StagingBuffer, spans: Sequence[tuple[int, int]]
    ) -> list[int]:
        if not keys:
            return []
        full, ptrs, sizes = self._zero_copy_args(keys, buf, spans)
        res = self.conn.call(lambda c: c.store.batch_get_into(full, ptrs, sizes), buf)
        if res is None or len(res) != len(keys):
            return [ERROR] * len(keys)
        out, failed = [], False
        for r in res:
            if r >= 0:
                out.append(r)
            elif r == OBJECT_NOT_FOUND:
                out.append(MISSING)
            elif r == BUFFER_TOO_SMALL:
                out.append(TOO_LARGE)
            else:
                out.append(ERROR)
                failed = True
        if failed:
            self.conn.failed()
        return out

    def batch_set_from(
        self, keys: Sequence[str], buf: StagingBuffer, spans: Sequence[tuple[int, int]]
    ) -> list[bool]:
        if not keys:
            return []
        full, ptrs, sizes = self._zero_copy_args(keys, buf, spans)
        res = self.conn.call(lambda c: c.store.batch_put_from(full, ptrs, sizes), buf, write=True)
        return self._set_results(res, len(keys))

    def stats(self) -> dict[str, float]:
        return self.conn.stats()

    def close(self) -> None:
        self.conn.close()

    # ------------------------------------------------------------------ internals
    def _set_results(self, res: list[int] | None, n: int) -> list[bool]:
        if res is None or len(res) != n:
            return [False] * n
        out = [r == 0 for r in res]
        if not all(out):
            self.conn.failed()
        return out

    @staticmethod
    def _check_spans(buf: StagingBuffer, spans: Sequence[tuple[int, int]]) -> None:
        for off, size in spans:
            if off < 0 or size <= 0 or off + size > buf.nbytes:
                raise ValueError(f"span ({off}, {size}) outside a buffer of {buf.nbytes} bytes")
