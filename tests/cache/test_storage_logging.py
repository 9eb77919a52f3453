"""L3 trouble is logged as well as counted (issue 13), rate-limited: a corrupt value, a failed
write, a dropped write-back each leave a warning in the log, and a flood of them leaves one
per interval that says how many it held back."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from harness.model_utils import tiny_model
from hicache.keys import namespace_for, page_keys
from hicache.ratelimited_log import RateLimitedLog
from hicache.tiers.device import KVLayout
from hicache.tiers.host import make_host_pool
from hicache.tiers.storage import StorageTier, make_storage
from serving.engine import Engine

PS = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
KEYS = page_keys(list(range(100, 100 + 6 * PS)), PS, namespace_for("test/model", LAYOUT, page_size=PS))


def warnings(caplog: pytest.LogCaptureFixture, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and word in r.getMessage()]


def test_rate_limited_log_holds_back_and_reports_the_count(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    rl = RateLimitedLog(logging.getLogger("hicache.test"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="hicache.test"):
        assert rl.warning("a", "page %d is bad", 1)
        assert not rl.warning("a", "page %d is bad", 2) and not rl.warning("a", "page %d is bad", 3)
        assert rl.warning("b", "another kind")  # each kind has its own interval
        now[0] = 10.5
        assert rl.warning("a", "page %d is bad", 4)
    assert [r.getMessage() for r in caplog.records] == [
        "page 1 is bad", "another kind", "page 4 is bad (2 more like it in the last 10 s not logged)"]


def _tier(tmp_path) -> tuple[StorageTier, object, object]:
    store = make_storage("lmdb", {"path": str(tmp_path / "db"), "capacity_gb": 0.05})
    tier = StorageTier(store, LAYOUT, PS)
    pool = make_host_pool("page_first", LAYOUT, 8, PS)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=torch.Generator().manual_seed(1)).to(pool.buffer.dtype))
    return tier, store, pool


def test_a_corrupt_value_is_logged(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    tier, store, pool = _tier(tmp_path)
    assert tier.batch_set(KEYS, pool, list(range(6))) == 6
    for k in (KEYS[1], KEYS[3]):
        raw = bytearray(store.get(k))
        raw[len(raw) // 2] ^= 0x01
        assert store.set(k, bytes(raw))
    dst = make_host_pool("page_first", LAYOUT, 8, PS)
    with caplog.at_level(logging.WARNING, logger="hicache.storage"):
        assert tier.batch_get(KEYS, dst, list(range(6))) == 1
        assert tier.batch_get(KEYS[3:], dst, [0, 1, 2]) == 0
    assert tier.stats()["corrupt"] == 2
    logged = warnings(caplog, "corrupt")
    # one line (the second within the interval is held back); reader threads may meet either first
    assert len(logged) == 1 and (KEYS[1] in logged[0] or KEYS[3] in logged[0]), logged
    tier.close()


def test_a_failed_write_is_logged(tmp_path, caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    tier, store, pool = _tier(tmp_path)
    failing = lambda keys, *_: [True] + [False] * (len(keys) - 1)  # noqa: E731 (framed values, or parts)
    monkeypatch.setattr(store, "batch_set_from", failing)
    monkeypatch.setattr(store, "batch_set_parts", failing)
    with caplog.at_level(logging.WARNING, logger="hicache.storage"):
        assert tier.batch_set(KEYS, pool, list(range(6))) == 1
    assert tier.stats()["store_failed"] == 5
    assert warnings(caplog, "5 of 6 pages could not be written"), caplog.text
    tier.close()


def test_a_write_back_behind_is_logged_and_still_written(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    eng = Engine(model_path=str(tiny_model(tmp_path / "model")), page_size=4, max_total_tokens=256,
                 hicache_ratio=2.0, hicache_storage_backend="lmdb", hicache_storage_write_queue_pages=2,
                 hicache_storage_backend_extra_config={"path": str(tmp_path / "l3"), "capacity_gb": 0.05,
                                                       "initial_map_mb": 1})
    release = threading.Event()
    eng.core.storage.writeback.before_write = lambda: release.wait(30)  # the first write stays queued
    greedy = {"max_new_tokens": 2, "temperature": 0}
    try:
        with caplog.at_level(logging.WARNING, logger="hicache.storage"):
            for prompt in (list(range(5, 40)), list(range(300, 335))):
                for _ in range(2):  # the second time hits it: its pages go to L2, then on to L3
                    eng.generate(input_ids=[prompt], sampling_params=greedy)
            waiting = eng.core.storage.writeback.waiting_pages
            release.set()
            eng.core.storage.poll(wait=True)
        st = eng.core.storage_stats()
    finally:
        release.set()
        eng.shutdown()
    assert waiting > 0 and st["write_pages_dropped"] == 0 and st["write_pages_waiting"] == 0, (waiting, st)
    assert st["pages_written"] >= 16, st  # both prompts' pages, the one that waited included
    assert warnings(caplog, "write-back is behind"), caplog.text
