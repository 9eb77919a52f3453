"""Prometheus metrics on the server's own registry.

Latencies (time to first token, inter-token latency, end-to-end) are measured in the HTTP
process, where clients see them. Token and page counts come from the engine process: each
scrape of /metrics asks it for a fresh ``Stats`` snapshot, exposed by a custom collector.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "hicache"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector(Collector):
    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if not s:
            return
        for name, key, doc in (
            ("prompt_tokens", "prompt_tokens", "Prompt tokens of admitted requests"),
            ("cached_tokens", "cached_tokens", "Prompt tokens served from the cache"),
            ("generated_tokens", "generated_tokens", "Generated tokens"),
            ("retractions", "retractions", "Requests preempted for lack of KV pages"),
            ("forward_passes", "forward_passes", "Engine forward passes"),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=s[key])
        hits = CounterMetricFamily(
            f"{PREFIX}_cache_hit_tokens", "Prompt tokens served from the cache, by tier", labels=["tier"]
        )
        for tier, n in sorted(s["cached_by_tier"].items()):
            hits.add_metric([tier], n)
        yield hits
        used = GaugeMetricFamily(
            f"{PREFIX}_pages_used", "KV pages in use or cached, by pool", labels=["pool"]
        )
        total = GaugeMetricFamily(f"{PREFIX}_pages_total", "KV pages, by pool", labels=["pool"])
        for pool, p in sorted(s["pages"].items()):
            used.add_metric([pool], p["used"])
            total.add_metric([pool], p["total"])
        yield used
        yield total
        storage = s.get("storage") or {}
        if storage:
            fam = CounterMetricFamily(
                f"{PREFIX}_storage_pages", "L3 storage tier page counters (hits, misses, corrupt, stored, "
                "errors, ...)", labels=["event"])
            for event, n in sorted(storage.items()):
                fam.add_metric([event.replace("backend.", "backend_")], float(n))
            yield fam
        yield GaugeMetricFamily(f"{PREFIX}_num_running_reqs", "Requests running", value=s["running"])
        yield GaugeMetricFamily(f"{PREFIX}_num_waiting_reqs", "Requests waiting", value=s["waiting"])
        yield GaugeMetricFamily(f"{PREFIX}_num_sessions", "Open sessions", value=s["sessions"])


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine = EngineCollector()
        self.registry.register(self.engine)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Request latency, end to end",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def on_tokens(self, state: Any, new: int) -> None:
        """Called by the engine client for each update of a request (``new`` ids arrived)."""
        now = time.monotonic()
        if new > 0:
            if state.first_token_time is None:
                state.first_token_time = now
                self.ttft.observe(now - state.created)
                new -= 1
            elif state.last_token_time is not None:
                gap = (now - state.last_token_time) / new
                for _ in range(new):
                    self.itl.observe(gap)
            state.last_token_time = now
        if state.finished:
            self.e2e.observe(now - state.created)

    def render(self, snapshot: dict[str, Any]) -> bytes:
        self.engine.snapshot = snapshot
        return generate_latest(self.registry)
