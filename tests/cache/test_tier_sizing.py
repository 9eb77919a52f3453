"""Tier sizes that fit the host (hicache.sizing): an explicit size past what the host or the disk
has is one line and exit status 2 at start-up, naming the number, what is available and the flag;
a derived size (hicache_ratio x L1, LMDB's default capacity) is clamped with a warning and the
server serves. The host's facts are set through HICACHE_TEST_MEM_* / HICACHE_TEST_DISK_FREE_GB."""

from __future__ import annotations

import httpx
import pytest

from harness.cli_run import assert_one_line, l3, serve
from harness.model_utils import tiny_model
from harness.server_utils import ServerProcess
from hicache import sizing
from hicache.sizing import GiB, HostMemory, SizeRequest, TierSizeError

SMALL_HOST = {sizing.MEM_TOTAL_ENV: "8", sizing.MEM_AVAILABLE_ENV: "3"}  # 3 GiB less 2 GiB headroom: 1 GiB


def test_host_memory_and_the_rule():
    mem = HostMemory.probe(SMALL_HOST)
    assert (mem.total, mem.available, mem.headroom, mem.budget()) == (8 * GiB, 3 * GiB, 2 * GiB, GiB)
    assert mem.budget(share=2) == GiB // 2
    real = HostMemory.probe({})
    assert 0 < real.available <= real.total
    assert real.source in ("MemAvailable", "the cgroup's memory limit less its usage")
    asked = SizeRequest(4 * GiB, True, "--hicache-size 4 GiB", "--hicache-size")
    with pytest.raises(TierSizeError, match=r"^L2: --hicache-size 4 GiB does not fit: .*1\.0 GiB.*lower"):
        sizing.fit("L2", asked, mem.budget(), mem.explain())
    derived = SizeRequest(4 * GiB, False, "hicache_ratio 2 x L1 = 4.0 GiB", "--hicache-size")
    got, warning = sizing.fit("L2", derived, mem.budget(), mem.explain())
    assert got == GiB and "clamped to 1.0 GiB" in warning and "--hicache-size" in warning
    assert sizing.fit("L2", derived, 8 * GiB, "") == (4 * GiB, None)
    with pytest.raises(TierSizeError, match="not even"):
        sizing.fit("L1", derived, 100, "the GPU has 100 bytes", minimum=1 << 20)


def test_l3_capacity_against_the_disk(tmp_path):
    disk = {sizing.DISK_FREE_ENV: "2"}
    with pytest.raises(TierSizeError, match=r"capacity_gb 8 GiB does not fit: .* 2\.0 GiB free .*; lower capacity_gb"):
        sizing.plan_l3("lmdb", {"path": str(tmp_path), "capacity_gb": 8.0}, disk)
    extra, warning = sizing.plan_l3("lmdb", {"path": str(tmp_path)}, disk)  # the default capacity, 64 GiB
    # clamped, leaving a tenth of the free space to the rest of the disk (with writemap the store
    # reserves its whole capacity at open: it took every free byte)
    assert extra["capacity_gb"] == pytest.approx(1.8) and "(the default)" in warning, extra
    assert "10% of the free space left" in warning, warning
    assert sizing.plan_l3("lmdb", {"path": str(tmp_path), "capacity_gb": 1.0}, disk) == (
        {"path": str(tmp_path), "capacity_gb": 1.0}, None)
    assert sizing.plan_l3("mooncake", {"global_segment_mb": 10**6}, disk)[1] is None  # not a disk tier


def test_a_sharded_stores_own_files_count_as_free_for_it(tmp_path):
    """A sharded LMDB (hicache/tiers/lmdb: ``shard-N`` folders) reopened: its shards' files are its own
    room, as a single environment's are (the shard folders were counted as 0 bytes)."""
    for i in range(2):
        (tmp_path / f"shard-{i}").mkdir()
        (tmp_path / f"shard-{i}" / "data.mdb").write_bytes(b"\1" * (10 << 20))  # 10 MiB each, allocated
    (tmp_path / "shards").write_text("2")
    disk = {sizing.DISK_FREE_ENV: str(10 / 1024)}  # 10 MiB free beside them
    extra, warning = sizing.plan_l3("lmdb", {"path": str(tmp_path), "capacity_gb": 28 / 1024}, disk)
    assert warning is None and extra["capacity_gb"] == 28 / 1024


def test_explicit_l2_larger_than_the_host_is_one_line():
    line = assert_one_line(serve("--config", "configs/l3.yaml", "--hicache-size", "64", env=SMALL_HOST),
                           "--hicache-size 64 GiB", "1.0 GiB", "HICACHE_TEST_MEM_AVAILABLE_GB 3.0 GiB")
    assert line.endswith("lower --hicache-size")


def test_explicit_l3_larger_than_the_disk_is_one_line(tmp_path):
    assert_one_line(serve(*l3(tmp_path / "l3", capacity_gb=8), env={sizing.DISK_FREE_ENV: "1"}),
                    "capacity_gb 8 GiB", "1.0 GiB free", "--hicache-storage-backend-extra-config")


def test_max_total_tokens_larger_than_the_host_is_one_line(tmp_path):
    """Checked once the weights are in (on a GPU, against its free memory); the same one line."""
    model = tiny_model(tmp_path / "m")  # 512 bytes of KV per token
    out = serve("--model-path", str(model), "--attention-backend", "torch", "--max-total-tokens", "10000000",
                "--hicache-storage-backend", "lmdb",
                "--hicache-storage-backend-extra-config", f'{{"path": "{tmp_path / "l3"}", "capacity_gb": 0.05}}',
                env=SMALL_HOST)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "Traceback" not in text and "persist" not in text, text
    errors = [ln for ln in text.splitlines() if " ERROR " in ln]
    assert len(errors) == 1 and "--max-total-tokens 10000000 (4.8 GiB of KV) does not fit" in errors[0], text
    assert "the host has 1.0 GiB for it" in errors[0] and errors[0].endswith("lower --max-total-tokens"), text


def test_derived_sizes_are_clamped_and_the_server_serves(tmp_path):
    """configs/l3.yaml on a small host and a small disk: L2 (2 x L1 = 1.4 GiB) is clamped to the 1 GiB
    the host has, LMDB's default capacity (64 GiB) to 90 % of the 2 GiB the disk has; it comes up and answers."""
    s = ServerProcess(["--config", "configs/l3.yaml", "--hicache-storage-backend-extra-config",
                       f'{{"path": "{tmp_path / "l3"}"}}'])
    s.env.update({**SMALL_HOST, sizing.DISK_FREE_ENV: "2"})
    s.start()
    try:
        r = httpx.post(s.url + "/generate", timeout=120, json={
            "text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 200, r.text
        assert r.json()["text"]
    finally:
        code = s.stop()
    log = s.log()
    assert code == 0, log
    assert "Traceback" not in log, log
    assert "L2: hicache_ratio 2 x L1 = 1.4 GiB does not fit: the host has 1.0 GiB for it" in log, log
    assert "clamped to 1.0 GiB (set --hicache-size to choose the size)" in log, log
    assert "L3: capacity_gb 64 GiB (the default) does not fit" in log and "clamped to 1.8 GiB" in log, log


def test_max_total_tokens_with_the_window_pool_counts_the_pools_bytes(tmp_path, monkeypatch):
    """With the hybrid SWA L1, --max-total-tokens counts the full layers' tokens (as SGLang does): each costs
    its full layers' KV and the window pool's share of its window layers'. A tiny Gemma-3 (2 full, 4 window
    layers; 1,536 bytes a token with every layer full, 717 with the pool at 0.2) and 0.1 GiB of host: 100,000
    tokens (146 MiB every layer full, 68 MiB in the pool) start and serve; 200,000 (137 MiB) are refused,
    naming the pool's bytes. The check counted every layer full, and refused the first."""
    from serving.engine import Engine

    model = tiny_model(tmp_path / "m", "gemma3")
    monkeypatch.setenv(sizing.MEM_TOTAL_ENV, "8")
    monkeypatch.setenv(sizing.MEM_AVAILABLE_ENV, "2.1")  # less 2 GiB of headroom: 0.1 GiB
    kw = dict(model_path=str(model), page_size=4, enable_hybrid_swa_memory=True, swa_full_tokens_ratio=0.2)
    eng = Engine(max_total_tokens=100_000, **kw)
    try:
        pool = eng.core.runner.pool
        assert pool.num_pages == 25_000 and pool.windows.num_pages == 5_000
        out = eng.generate(input_ids=list(range(1, 40)), sampling_params={"max_new_tokens": 3, "temperature": 0})
        assert len(out["output_ids"]) == 3
    finally:
        eng.shutdown()
    with pytest.raises(TierSizeError, match=r"--max-total-tokens 200000 \(137 MiB of KV\) does not fit"):
        Engine(max_total_tokens=200_000, **kw)
