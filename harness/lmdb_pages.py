"""A real LMDB store with small pages for the storage tests: the layout, filled pools, keys."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from hicache.keys import namespace_for, page_keys
from hicache.tiers.device import KVLayout
from hicache.tiers.lmdb.store import LMDBStore
from hicache.tiers.storage import make_storage

PS = 16

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)  # 4 KiB pages


NS = namespace_for("test/model", SMALL, page_size=PS)


def fill(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(pool.buffer.dtype))


def keys_for(n: int, salt: int = 0) -> list[str]:
    return page_keys([(salt * 7919 + t) % 50000 for t in range(n * PS)], PS, NS)


def open_store(path: Path, **kw) -> LMDBStore:
    return make_storage("lmdb", {"path": str(path), **kw})


def writer_and_readers(store: LMDBStore, tier, src, keys: list[str], rounds: int) -> list[BaseException]:  # noqa: ANN001
    """One writer rewriting 16-page slices of ``keys`` (from ``src``'s pages of the same index) for ``rounds``
    rounds and deleting a key every fifth, two readers reading slices meanwhile and checking every page they
    got against ``src``; returns what any thread raised (nothing: every read was right)."""
    from hicache.tiers.host import make_host_pool

    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        try:
            for r in range(rounds):
                lo = 16 * (r % 16)
                assert tier.batch_set(keys[lo: lo + 16], src, list(range(lo, lo + 16))) == 16
                if r % 5 == 0:
                    store.delete(keys[r])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            stop.set()

    def reader(seed: int) -> None:
        dst = make_host_pool("layer_first", SMALL, 16, PS)
        r = seed
        try:
            while not stop.is_set():
                lo = 16 * (r % 16)
                r += 3
                n = tier.batch_get(keys[lo: lo + 16], dst, list(range(16)))
                got, want = dst.read_pages(torch.arange(n)), src.read_pages(torch.arange(lo, lo + n))
                assert torch.equal(got, want), "a reader got wrong bytes"
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def page_data(layout: KVLayout, i: int) -> torch.Tensor:
    """Deterministic content of page number ``i``: ``[2 * layers, 1, row_elems]``."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(2 * layout.num_layers, 1, PS * layout.num_kv_heads * layout.head_dim, generator=g).to(
        layout.dtype)


def kill_writer(script: str, path: Path, repo: Path, pages: int = 120) -> list[int]:
    """Run ``script writer PATH`` (a writer process that prints each page number once it is committed), kill it
    (SIGKILL) once it printed ``pages`` pages, in the middle of its next transactions; the pages it printed."""
    proc = subprocess.Popen([sys.executable, script, "writer", str(path)], stdout=subprocess.PIPE, text=True,
                            cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    committed: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(committed) < pages and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            committed.append(int(line))
        time.sleep(0.05)  # let it be in the middle of the next transactions
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    assert len(committed) >= pages, f"writer printed only {len(committed)} pages"
    return committed


def assert_committed(tier, committed: list[int]) -> None:  # noqa: ANN001 (a StorageTier of SMALL pages)
    """Every page a killed writer printed as committed (:func:`kill_writer`) reads back whole."""
    from hicache.tiers.host import make_host_pool

    keys = keys_for(10_000)
    pool = make_host_pool("layer_first", SMALL, 1, PS)
    for i in committed:
        assert tier.batch_get([keys[i]], pool, [0]) == 1, f"committed page {i} lost"
        assert torch.equal(pool.read_pages(torch.tensor([0])), page_data(SMALL, i))
