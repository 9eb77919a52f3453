"""/metrics follows Prometheus' naming rules (issue 13): counters end in ``_total``, gauges
never do, units are in the names; every key of the engine's real L3 stats (LMDB engine, and
a Mooncake backend's keys) maps onto a typed metric. Checked with prometheus_client's parser,
and with ``promtool check metrics`` where it is installed."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.model_utils import tiny_model
from serving.engine import Engine
from serving.server.metrics import ServerMetrics

MOONCAKE_BACKEND = {"backend.errors": 0, "backend.timeouts": 1, "backend.unavailable": 0, "backend.setups": 1,
                    "backend.reconnects": 0, "backend.connected": 1}


@pytest.fixture(scope="module")
def storage_stats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """The storage stats of a real engine with an LMDB L3 after some traffic."""
    tmp = tmp_path_factory.mktemp("metrics")
    eng = Engine(model_path=str(tiny_model(tmp / "model")), page_size=4, max_total_tokens=256, hicache_ratio=2.0,
                 hicache_storage_backend="lmdb",
                 hicache_storage_backend_extra_config={"path": str(tmp / "l3"), "capacity_gb": 0.05,
                                                       "initial_map_mb": 1})
    try:
        for _ in range(2):
            eng.generate(input_ids=[list(range(5, 40))], sampling_params={"max_new_tokens": 2, "temperature": 0})
        eng.core.storage.poll(wait=True)
        stats = dict(eng.core.storage_stats())
    finally:
        eng.shutdown()
    assert stats["stored"] > 0
    return stats


def snapshot(storage: dict[str, float]) -> dict[str, Any]:
    return {"prompt_tokens": 70, "cached_tokens": 32, "cached_by_tier": {"device": 32, "host": 0, "storage": 0},
            "generated_tokens": 4, "retractions": 0, "forward_passes": 4, "running": 0, "waiting": 0,
            "sessions": 0, "pages": {"device": {"total": 64, "used": 10}, "host": {"total": 128, "used": 20}},
            "storage": storage}


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_names_follow_prometheus_rules(storage_stats: dict[str, float]) -> None:
    text = ServerMetrics().render(snapshot({**storage_stats, **MOONCAKE_BACKEND})).decode()
    fams = families(text)
    for name, fam in fams.items():
        assert name.startswith("hicache_"), name
        samples = {s.name for s in fam.samples}
        if fam.type == "counter":
            assert all(s.endswith(("_total", "_created")) for s in samples), (name, samples)
        else:
            assert not any(s.endswith("_total") for s in samples), (name, fam.type, samples)
        assert fam.type != "unknown", f"{name}: a stat without a typed metric ({samples})"
    # KV pools: one gauge, labelled by pool and state
    pool = fams["hicache_pool_pages"]
    assert pool.type == "gauge"
    got = {(s.labels["pool"], s.labels["state"]): s.value for s in pool.samples}
    assert got == {("device", "used"): 10, ("device", "free"): 54, ("host", "used"): 20, ("host", "free"): 108}
    # L3: quantities are gauges with their unit, events and bytes moved are counters
    for name, kind in (("hicache_storage_used_bytes", "gauge"), ("hicache_storage_capacity_bytes", "gauge"),
                       ("hicache_storage_read_bytes", "counter"), ("hicache_storage_written_bytes", "counter"),
                       ("hicache_storage_read_seconds", "counter"), ("hicache_storage_write_seconds", "counter"),
                       ("hicache_storage_events", "counter"), ("hicache_storage_connected", "gauge"),
                       ("hicache_cost_model_l3_read_bytes_per_second", "gauge"),
                       ("hicache_cost_model_l3_fixed_seconds", "gauge"),
                       ("hicache_cost_model_prefill_tokens_per_second", "gauge"),
                       ("hicache_cost_model_l3_refusals", "counter"),
                       ("hicache_cost_model_recomputed_cached_tokens", "counter")):
        assert name in fams and fams[name].type == kind, (name, fams.get(name))
    [cap] = fams["hicache_storage_capacity_bytes"].samples
    assert cap.value == storage_stats["backend.capacity_bytes"] > 0
    [read] = [s for s in fams["hicache_storage_read_bytes"].samples if s.name.endswith("_total")]
    assert read.value == storage_stats["bytes_read"]
    events = {s.labels["event"]: s.value for s in fams["hicache_storage_events"].samples
              if s.name.endswith("_total")}
    for event in ("hits", "misses", "corrupt", "stored", "store_failed", "pages_written", "pages_prefetched",
                  "prefetches_revoked", "write_pages_dropped", "write_retries", "backend_errors", "backend_evicted",
                  "backend_timeouts", "backend_reconnects"):
        assert event in events, event
    assert events["stored"] == storage_stats["stored"] > 0
    assert not any("bytes" in e or e.endswith("_s") for e in events), events  # no quantities among the events
    # the old names are gone: a counter mixing gauges and bytes, a gauge named like a counter
    assert "hicache_storage_pages" not in fams and "hicache_pages_total" not in fams
    assert "hicache_pages_total{" not in text and "hicache_storage_pages_total{" not in text


def test_promtool_check_metrics(storage_stats: dict[str, float]) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    text = ServerMetrics().render(snapshot({**storage_stats, **MOONCAKE_BACKEND}))
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        done.stdout.decode() + done.stderr.decode())


def test_http_request_metrics_follow_the_rules_and_no_created_series(storage_stats: dict[str, float]) -> None:
    """Issue 25, finding 11: requests by route template, method and status, their durations, no
    ``_created`` series (Prometheus ingests them as gauges of their own); the engine's last
    snapshot is served marked stale when it did not answer this scrape."""
    metrics = ServerMetrics()
    metrics.on_request("/v1/chat/completions", "POST", 200, 0.25)
    metrics.on_request("/v1/chat/completions", "POST", 504, 60.0)
    metrics.on_request("unmatched", "GET", 404, 0.001)
    state = type("State", (), {"first_token_time": None, "last_token_time": None, "created": 0.0,
                               "finished": True})()
    metrics.on_tokens(state, 2)  # the latency histograms get samples too
    text = metrics.render(snapshot(storage_stats)).decode()
    assert "_created" not in text
    fams = families(text)
    for name, fam in fams.items():
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples), name
    reqs = {(s.labels["route"], s.labels["method"], s.labels["status"]): s.value
            for s in fams["hicache_http_requests"].samples}
    assert reqs == {("/v1/chat/completions", "POST", "200"): 1, ("/v1/chat/completions", "POST", "504"): 1,
                    ("unmatched", "GET", "404"): 1}
    dur = fams["hicache_http_request_duration_seconds"]
    assert dur.type == "histogram"
    [count] = [s for s in dur.samples if s.name.endswith("_count") and s.labels["route"] == "/v1/chat/completions"]
    assert count.value == 2
    assert fams["hicache_engine_stats_stale"].samples[0].value == 0
    stale = families(metrics.render(None, stall_s=7.0).decode())  # the engine did not answer
    assert stale["hicache_engine_stats_stale"].samples[0].value == 1
    assert stale["hicache_engine_stall_seconds"].samples[0].value == 7.0
    assert stale["hicache_forward_passes"].samples[0].value == 4  # the last snapshot's
    first = {"hicache_engine_stall_seconds", "hicache_engine_stats_stale"}  # no snapshot yet: no engine families
    assert families(ServerMetrics().render(None).decode()).keys() == first | {
        n for n in fams if n.startswith(("hicache_http", "hicache_time_", "hicache_inter_", "hicache_e2e_"))}


def test_a_first_scrape_during_a_stall_says_stale() -> None:
    """Issue 42: the engine never answered (stalled before the first scrape): there is no
    snapshot to serve, and the scrape still says the engine's metrics are stale."""
    fams = families(ServerMetrics().render(None, stall_s=12.0).decode())
    assert fams["hicache_engine_stats_stale"].samples[0].value == 1
    assert fams["hicache_engine_stall_seconds"].samples[0].value == 12.0
    assert "hicache_engine_stats_age_seconds" not in fams  # the age of no snapshot: not made up
