"""The KV control API's lookup (``POST /cache/lookup``), engine side: how many leading tokens of
a (salted) prompt are cached on L1, on L2 only, and in L3 after them. L1/L2 come from a
read-only tree walk; the L3 count needs the store, so it runs on a worker thread and the answer
is deferred (:meth:`PrefixLookup.poll` hands it back). Part of serving/cache/kv_control.py.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from hicache import salt
from hicache.keys import page_keys
from serving.cache.control_core import ControlCore


class PrefixLookup:
    """Lookups of one engine, and their deferred L3 answers.

    Concurrency contract: engine loop thread only, except the L3 existence check, which runs on
    one worker thread (``_l3``) and touches only the storage tier (thread-safe) and values
    computed before it was submitted; :meth:`poll` hands its answers back on the loop thread.
    """

    def __init__(self, core: ControlCore) -> None:
        self.core = core
        self.tree = core.tree
        self.page_size = core.config.cache.page_size
        self._deferred: list[tuple[int, Future]] = []
        self._l3 = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hicache-kv-lookup") \
            if core.storage is not None else None

    def lookup(self, input_ids: list[int], cache_salt: str | None) -> dict[str, int] | Future:
        tokens = salt.apply(input_ids, salt.salt_tags(cache_salt))
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        device = host = 0
        on_device = True
        for node, _pos, m in self.tree.walk(tokens, n):
            on_device = on_device and node.device_pages is not None
            if on_device:
                device += m
            else:
                host += m
        out = {"L1": device, "L2": host, "L3": 0, "prompt_tokens": len(input_ids)}
        storage = self.core.storage
        if self._l3 is None or device + host >= n:
            return out
        namespace, tier = storage.writeback.namespace, storage.tier
        start = (device + host) // ps

        def check() -> dict[str, int]:
            keys = page_keys(tokens[:n], ps, namespace)[start:]
            return {**out, "L3": tier.batch_exists(keys) * ps}

        return self._l3.submit(check)

    def defer(self, call_id: int, future: Future) -> None:
        self._deferred.append((call_id, future))

    @property
    def busy(self) -> bool:
        return bool(self._deferred)

    def poll(self) -> list[tuple[int, Any, Exception | None]]:
        """Deferred answers that are ready: (call_id, value, error)."""
        done, keep = [], []
        for call_id, fut in self._deferred:
            if fut.done():
                err = fut.exception()
                done.append((call_id, None if err else fut.result(), err))
            else:
                keep.append((call_id, fut))
        self._deferred = keep
        return done

    def shutdown(self) -> None:
        if self._l3 is not None:
            self._l3.shutdown(wait=True)
