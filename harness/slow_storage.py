"""A real LMDB store whose calls are slowed down (or throttled) on purpose, for tests.

Registered in the storage registry under a test-local name, so an engine is built with it
exactly like with ``lmdb``: ``hicache_storage_backend="slow_lmdb"`` and the usual LMDB
options plus ``delay_s`` (sleep before each batch call) and ``read_mb_s`` (throttle reads
to that many MB/s, 0 = unthrottled; staged and direct reads alike); ``slow_calls`` names the calls
``delay_s`` slows (``exists``, ``get``: staged reads, ``set``; ``pages``: direct reads, not unless named).

Deterministic holds: :meth:`SlowLMDBStore.hold` makes every value read (staged or direct)
wait at its start until :meth:`release`; ``held`` lists the keys of the reads waiting there,
``keys_read`` counts how often each key's value was read.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from hicache import config_fields
from hicache.tiers import storage
from hicache.tiers.lmdb.config import LMDBConfig
from hicache.tiers.lmdb.store import LMDBStore


class SlowLMDBStore(LMDBStore):
    def __init__(self, config: LMDBConfig, delay_s: float = 0.0, read_mb_s: float = 0.0,
                 slow_calls: Sequence[str] = ("exists", "get", "set")) -> None:
        super().__init__(config)
        self.delay_s = delay_s
        self.read_mb_s = read_mb_s
        self.slow_calls = frozenset(slow_calls)
        self.calls: dict[str, int] = {"exists": 0, "get": 0, "set": 0, "pages": 0}  # started
        self.finished: dict[str, int] = {"exists": 0, "get": 0, "set": 0, "pages": 0}
        self.in_call = threading.Event()  # set while any slowed call sleeps (tests watch it)
        self.keys_read: Counter[str] = Counter()  # values read, per key
        self.held: list[list[str]] = []  # keys of the reads waiting in a hold
        self._gate = threading.Event()
        self._gate.set()
        self._lock = threading.Lock()

    def hold(self) -> None:
        """From now on every value read waits at its start (listed in ``held``) until :meth:`release`."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def _enter_read(self, keys: Sequence[str]) -> None:
        if self._gate.is_set():
            return
        entry = list(keys)
        with self._lock:
            self.held.append(entry)
        self._gate.wait()
        with self._lock:
            self.held.remove(entry)

    def _count_reads(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        with self._lock:
            self.keys_read.update(k for k, n in zip(keys, sizes, strict=True) if n >= 0)

    def _throttle(self, sizes: Sequence[int], t0: float) -> None:
        """With ``read_mb_s``: a read that started at ``t0`` lasts as long as its bytes take at that rate."""
        if self.read_mb_s > 0:
            nbytes = sum(n for n in sizes if n > 0)
            time.sleep(max(0.0, nbytes / (self.read_mb_s * 1e6) - (time.monotonic() - t0)))

    def busy(self, call: str) -> bool:
        """A call of this kind started and has not returned yet."""
        return self.finished[call] < self.calls[call]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SlowLMDBStore:
        cfg = dict(config)
        delay = float(cfg.pop("delay_s", 0.0))
        mb_s = float(cfg.pop("read_mb_s", 0.0))
        calls = cfg.pop("slow_calls", ("exists", "get", "set"))
        return cls(LMDBConfig.from_mapping(cfg), delay, mb_s, calls)

    def _slow(self, call: str) -> None:
        self.calls[call] += 1
        if call in self.slow_calls and self.delay_s > 0:
            self.in_call.set()
            time.sleep(self.delay_s)
            self.in_call.clear()

    def batch_exists(self, keys):
        self._slow("exists")
        try:
            return super().batch_exists(keys)
        finally:
            self.finished["exists"] += 1

    def batch_get_into(self, keys, buf, spans):
        self._enter_read(keys)
        self._slow("get")
        try:
            t0 = time.monotonic()
            out = super().batch_get_into(keys, buf, spans)
            self._count_reads(keys, out)
            self._throttle(out, t0)
            return out
        finally:
            self.finished["get"] += 1

    def batch_get_pages(self, keys, dsts, trailers, copy=None):
        self._enter_read(keys)
        self._slow("pages")
        try:
            t0 = time.monotonic()
            out = super().batch_get_pages(keys, dsts, trailers, copy)
            self._count_reads(keys, out)
            self._throttle(out, t0)
            return out
        finally:
            self.finished["pages"] += 1

    def batch_set_from(self, keys, buf, spans):
        self._slow("set")
        try:
            return super().batch_set_from(keys, buf, spans)
        finally:
            self.finished["set"] += 1


@contextmanager
def slow_lmdb_backend() -> Iterator[tuple[str, list[SlowLMDBStore]]]:
    """Registers ``slow_lmdb`` (in the backend registry and among the names the config accepts for
    ``hicache_storage_backend``) while the block runs; yields the name and the stores made. On the
    way out every store made is released (a read still held must not keep a process alive) and the
    registry is as it was."""
    made: list[SlowLMDBStore] = []

    def make(config: Mapping[str, Any]) -> SlowLMDBStore:
        made.append(SlowLMDBStore.from_config(config))
        return made[-1]

    allowed = config_fields.field_choices

    def with_slow_lmdb(f):
        names = allowed(f)
        return (*names, "slow_lmdb") if names is not None and f.name == "hicache_storage_backend" else names

    before = storage.STORAGE_BACKENDS.get("slow_lmdb")
    storage.STORAGE_BACKENDS["slow_lmdb"] = make
    config_fields.field_choices = with_slow_lmdb
    try:
        yield "slow_lmdb", made
    finally:
        config_fields.field_choices = allowed
        if before is None:
            storage.STORAGE_BACKENDS.pop("slow_lmdb", None)
        else:
            storage.STORAGE_BACKENDS["slow_lmdb"] = before
        for store in made:
            store.release()


@pytest.fixture
def slow_lmdb() -> Iterator[str]:
    """``slow_lmdb`` registered for the test (:func:`slow_lmdb_backend`); yields the backend name. A test
    that failed while its reads were held still ends its process: every store it made is released."""
    with slow_lmdb_backend() as (name, _):
        yield name
