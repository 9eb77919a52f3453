"""Prometheus metrics on the server's own registry.

Latencies (time to first token, inter-token latency, end-to-end) are measured in the HTTP
process, where clients see them, and so is every HTTP request (serving.server.access_log):
``hicache_http_requests_total{route,method,status}`` (route: the route's template, e.g.
``/v1/chat/completions``, or ``unmatched``; method: GET/POST/... or ``other``) and
``hicache_http_request_duration_seconds{route,method}``; connections closed for how a client sent
its request (edge.http_protocol): ``hicache_http_connections_closed_total{reason}``.
Token and page counts come from the engine process: each scrape of /metrics asks it for a fresh
``Stats`` snapshot, exposed by a custom collector. When the engine cannot answer at once
(stalled, or in a long forward pass), the last snapshot is served instead, marked
``hicache_engine_stats_stale 1`` with its age in ``hicache_engine_stats_age_seconds``; before
its first answer there is no snapshot: ``hicache_engine_stats_stale 1`` alone. No ``_created``
series (prometheus_client's are disabled).

Names follow Prometheus' rules: counters end in ``_total``, gauges never do, and a quantity
with a unit says it in base units (``_bytes``, ``_seconds``, ``_bytes_per_second``). The
engine's L3 stats (``EngineCore.storage_stats()``) map key by key (``STORAGE_METRICS``):

- ``hicache_storage_events_total{event}``: every L3 count: pages ``hits``, ``misses``,
  ``corrupt``, ``stored``, ``store_failed``, ``pages_written``, ``pages_prefetched``,
  ``write_pages_dropped``, ``write_retries``, ``pages_loaded_early``, prefetches ``prefetches_revoked``,
  the exclusive tiers' ``l2_demotions_dropped_pages``, ``l3_pages_promoted``, ``l3_promoted_pages_deleted``,
  and the backend's own counts as ``backend_<name>``
  (``backend_errors``, ``backend_evicted``, ``backend_timeouts`` ...);
- ``hicache_storage_read_bytes_total`` / ``_written_bytes_total``, ``hicache_storage_read_seconds_total``
  / ``_write_seconds_total`` (time inside reads and writes);
- gauges ``hicache_storage_used_bytes``, ``hicache_storage_capacity_bytes``, ``hicache_storage_entries``,
  ``hicache_storage_map_size_bytes``, ``hicache_storage_file_size_bytes`` (LMDB),
  ``hicache_storage_connected`` (Mooncake, 0 or 1);
- the load-or-recompute cost model: gauges ``hicache_cost_model_l3_read_bytes_per_second``,
  ``hicache_cost_model_l3_fixed_seconds``, ``hicache_cost_model_prefill_tokens_per_second``; counters
  ``hicache_cost_model_l3_refusals_total``, ``hicache_cost_model_recomputed_cached_tokens_total``.

A key without an entry (a new backend's) is still exposed, untyped, as ``hicache_storage_stat{key}``.
KV pools: ``hicache_pool_pages{pool,state}`` (state ``used`` or ``free``). A model with recurrent-state
layers: ``hicache_state_slots{pool,state}`` (state ``snapshots``: the tree's, ``requests``: running
requests' working slots and captures on L1, ``in_flight``: L2 slots an L3 write reads, ``free``). Speculative decoding
(when on): counters ``hicache_spec_verify_steps_total``, ``hicache_spec_draft_tokens_total``,
``hicache_spec_accepted_tokens_total``, ``hicache_spec_auto_off_total``; gauge
``hicache_spec_index_positions`` (the tree's n-gram index).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.registry import Collector

from serving.server.req_handle import ReqState

# a histogram's or counter's ``_created`` series is a timestamp that Prometheus ingests as a gauge
# of its own: noise in every dashboard (process-wide; the HTTP process has no other registry user)
disable_created_metrics()
PREFIX = "hicache"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
EVENTS = "storage_events"  # the counter family for dimensionless L3 counts, labelled by event


class StorageMetric(NamedTuple):
    kind: str  # "counter" | "gauge"
    name: str  # after PREFIX_, without _total (prometheus_client appends it to counters)
    doc: str
    scale: float = 1.0  # multiplies the stat into the metric's base unit
    skip_negative: bool = False  # a negative value means "unknown": not exposed


def _event(doc: str) -> StorageMetric:
    return StorageMetric("counter", EVENTS, doc)


STORAGE_METRICS: dict[str, StorageMetric] = {
    # the storage tier (hicache.tiers.storage), pages
    "hits": _event("pages loaded from L3 and verified"),
    "misses": _event("pages asked of L3 and not loaded"),
    "corrupt": _event("pages L3 returned that failed their checksum (deleted, treated as misses)"),
    "stored": _event("pages written to L3"),
    "store_failed": _event("pages L3 failed to write"),
    "bytes_read": StorageMetric("counter", "storage_read_bytes", "Bytes read from L3 (trailers included)"),
    "bytes_written": StorageMetric("counter", "storage_written_bytes", "Bytes written to L3 (trailers included)"),
    "read_s": StorageMetric("counter", "storage_read_seconds", "Wall time spent in L3 reads"),
    "write_s": StorageMetric("counter", "storage_write_seconds", "Wall time spent in L3 writes"),
    # the storage controller (serving.cache.storage_controller)
    "pages_written": _event("pages the write-back wrote to L3"),
    "pages_prefetched": _event("pages prefetched from L3 into L2"),
    "prefetches_revoked": _event("prefetches revoked"),
    "pages_loaded_early": _event("prefetched pages loaded on to L1 as their batch landed (pipelined)"),
    "fetches_followed": _event("prefetches that waited for another request's fetch of the same prefix"),
    "pages_deduplicated": _event("pages a prefetch found already being read by another request's fetch"),
    "fetches_cut": _event("prefetches cut once their fetch fell behind recompute (the rest recomputed)"),
    "pages_cut": _event("pages cut prefetches had not read (recomputed)"),
    "fetches_in_flight": StorageMetric("gauge", "storage_fetches_in_flight", "L3 fetches in flight"),
    # recurrent-state snapshots on L3 (hicache.tiers.storage_state), a model with state layers
    "state_stored": _event("state snapshots written to L3"),
    "state_store_failed": _event("state snapshots L3 failed to write"),
    "state_hits": _event("state snapshots read from L3 and verified"),
    "state_misses": _event("state snapshots asked of L3 and not found"),
    "state_corrupt": _event("state snapshots L3 returned that failed their check (deleted, treated as misses)"),
    "state_snapshots_fetched": _event("state snapshots prefetched from L3 into L2"),
    "write_pages_dropped": _event("pages whose write-back did not reach L3 (the store failed it)"),
    "write_retries": _event("pages of failed L3 writes handed back, still pinned, to be written again"),
    "l2_backups_skipped_pages": _event("L1 pages whose L2 backup found no room while L3 lacks them (skipped)"),
    "l2_demotions_dropped_pages": _event("L2 pages evicted in the exclusive mode before their write to L3 (lost)"),
    "l3_pages_promoted": _event("pages an L3 hit brought up whose L3 copy is given up (exclusive, private L3)"),
    "l3_promoted_pages_deleted": _event("L3 copies of promoted pages deleted from the store"),
    "write_pages_waiting": StorageMetric("gauge", "storage_write_waiting_pages",
                                         "Pages waiting for an L3 writer (back-pressure)"),
    "write_pages_waiting_max": StorageMetric("gauge", "storage_write_waiting_max_pages",
                                             "Most pages ever waiting for an L3 writer"),
    "write_pages_in_flight": StorageMetric("gauge", "storage_write_in_flight_pages",
                                           "Pages an L3 writer is storing (not yet marked stored)"),
    # the load-or-recompute policy (serving.cache.cost_model)
    "cost_l3_read_gbps": StorageMetric("gauge", "cost_model_l3_read_bytes_per_second",
                                       "Estimated L3 read bandwidth", 1e9),
    "cost_l3_fixed_ms": StorageMetric("gauge", "cost_model_l3_fixed_seconds",
                                      "Estimated fixed cost of one L3 read", 1e-3),
    "cost_prefill_tok_s": StorageMetric("gauge", "cost_model_prefill_tokens_per_second", "Estimated prefill rate"),
    "cost_l3_refusals": StorageMetric("counter", "cost_model_l3_refusals",
                                      "Requests whose L3 pages were recomputed rather than loaded"),
    "cost_tokens_recomputed_although_cached": StorageMetric(
        "counter", "cost_model_recomputed_cached_tokens", "Tokens recomputed although L3 held them"),
    # backends (hicache.tiers.lmdb.store, hicache.tiers.mooncake.store)
    "backend.errors": _event("backend errors"),
    "backend.evicted": _event("entries the backend evicted"),
    "backend.deleted": _event("entries the backend deleted"),
    "backend.map_grows": _event("LMDB map resizes"),
    "backend.timeouts": _event("backend calls that timed out"),
    "backend.unavailable": _event("backend calls refused while it was unavailable"),
    "backend.setups": _event("backend connection set-ups"),
    "backend.reconnects": _event("backend reconnections"),
    "backend.used_bytes": StorageMetric("gauge", "storage_used_bytes", "Bytes of L3 in use"),
    "backend.capacity_bytes": StorageMetric("gauge", "storage_capacity_bytes", "L3 capacity"),
    "backend.entries": StorageMetric("gauge", "storage_entries", "Values held by L3", skip_negative=True),
    "backend.map_size": StorageMetric("gauge", "storage_map_size_bytes", "LMDB map size"),
    "backend.shards": StorageMetric("gauge", "storage_shards", "LMDB environments the store is sharded into"),
    "backend.file_bytes": StorageMetric("gauge", "storage_file_size_bytes", "LMDB data file size",
                                        skip_negative=True),
    "backend.value_file_bytes": StorageMetric("gauge", "storage_value_file_bytes",
                                              "Bytes the LMDB value files hold on disk"),
    "backend.connected": StorageMetric("gauge", "storage_connected", "1 while the backend is connected"),
}


def event_label(key: str) -> str:
    return key.replace("backend.", "backend_")


def storage_families(stats: dict[str, float]) -> Iterator[Metric]:
    """The metric families of the engine's L3 stats (see the module docstring)."""
    events = CounterMetricFamily(f"{PREFIX}_{EVENTS}", "L3 storage events, by kind (see each event's name)",
                                 labels=["event"])
    unknown = UnknownMetricFamily(f"{PREFIX}_storage_stat", "L3 stats without a metric of their own",
                                  labels=["key"])
    singles: list[Metric] = []
    for key, value in sorted(stats.items()):
        spec = STORAGE_METRICS.get(key)
        if spec is None:
            unknown.add_metric([key], float(value))
        elif spec.skip_negative and value < 0:
            continue
        elif spec.name == EVENTS:
            events.add_metric([event_label(key)], float(value))
        else:
            family = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            singles.append(family(f"{PREFIX}_{spec.name}", spec.doc, value=float(value) * spec.scale))
    yield events
    yield from singles
    if unknown.samples:
        yield unknown


SPEC_COUNTERS = (  # (metric, key of the engine's "speculative" stats, doc)
    ("spec_verify_steps", "verify_steps", "Request decode steps that verified drafts (speculative decoding)"),
    ("spec_draft_tokens", "draft_tokens", "Draft tokens proposed (speculative decoding)"),
    ("spec_accepted_tokens", "accepted_tokens", "Draft tokens accepted (speculative decoding)"),
    ("spec_auto_off", "auto_off", "Times a request's drafting turned off for low acceptance"),
)


def speculative_families(spec: dict[str, Any]) -> Iterator[Metric]:
    for name, key, doc in SPEC_COUNTERS:
        yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=spec.get(key, 0))
    yield GaugeMetricFamily(f"{PREFIX}_spec_index_positions", "Positions held by the tree's n-gram index",
                            value=spec.get("index_positions", 0))


def tenant_families(tenants: dict[str, Any], bytes_per_page: dict[str, int]) -> Iterator[Metric]:
    """Per-tenant metrics (hicache.hiradix.quota.TenantLedger.snapshot; the label set is bounded:
    tenants of --api-keys-file, "default", "_other"): pages and bytes held per tier, quotas,
    requests, prompt tokens and cached tokens by tier."""
    pages = GaugeMetricFamily(f"{PREFIX}_tenant_pages", "KV pages a tenant holds, by tier (storage: written)",
                              labels=["tenant", "tier"])
    nbytes = GaugeMetricFamily(f"{PREFIX}_tenant_bytes", "KV bytes a tenant holds, by tier (storage: written)",
                               labels=["tenant", "tier"])
    quota = GaugeMetricFamily(f"{PREFIX}_tenant_quota_pages", "A tenant's soft quota, by tier",
                              labels=["tenant", "tier"])
    reqs = CounterMetricFamily(f"{PREFIX}_tenant_requests", "Finished requests", labels=["tenant"])
    prompt = CounterMetricFamily(f"{PREFIX}_tenant_prompt_tokens", "Prompt tokens", labels=["tenant"])
    hits = CounterMetricFamily(f"{PREFIX}_tenant_cache_hit_tokens", "Prompt tokens served from the cache, by tier",
                               labels=["tenant", "tier"])
    pinned = GaugeMetricFamily(f"{PREFIX}_tenant_pinned_pages", "L2 pages a tenant's pin leases and cache_control "
                               "breakpoints hold (each page once)", labels=["tenant"])
    pc = {k: CounterMetricFamily(f"{PREFIX}_tenant_{k}", doc, labels=["tenant"]) for k, doc in (
        ("prompt_cache_read_tokens", "cache_control requests' prompt tokens served from the cache (any tier)"),
        ("prompt_cache_creation_tokens", "Prompt tokens written into newly pinned cache_control prefixes"))}
    for name, row in sorted(tenants.items()):
        pinned.add_metric([name], row.get("pinned_pages", 0))
        for k, fam in pc.items():
            fam.add_metric([name], row["requests"].get(k, 0))
        for tier, n in sorted(row["pages"].items()):
            pages.add_metric([name, tier], n)
            nbytes.add_metric([name, tier], n * bytes_per_page.get(tier, 0))
        for tier, n in sorted(row["quota_pages"].items()):
            quota.add_metric([name, tier], n)
        r = row["requests"]
        reqs.add_metric([name], r.get("requests", 0))
        prompt.add_metric([name], r.get("prompt_tokens", 0))
        for key, n in sorted(r.items()):
            if key.startswith("cached_"):  # the prompt_cache_* counters have families of their own
                hits.add_metric([name, key.removeprefix("cached_")], n)
    yield from (pages, nbytes, quota, reqs, prompt, hits, pinned, *pc.values())


class EngineCollector(Collector):
    """The engine's families from the last ``Stats`` snapshot (``taken_at``: its
    ``time.monotonic()``; ``stale``: the engine did not answer this scrape)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}
        self.taken_at = 0.0
        self.stale = False
        self.stall_s = 0.0

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            f"{PREFIX}_engine_stall_seconds",
            "Seconds the engine has made no progress while work is pending, or its loop has not turned "
            "(the watchdog's measure; an idle engine's loop turns about once a second)",
            value=self.stall_s,
        )
        s = self.snapshot
        yield GaugeMetricFamily(f"{PREFIX}_engine_stats_stale",  # 1 too before the engine's first answer
                                "1 when the engine's metrics below are from an earlier scrape (it did not answer)",
                                value=1.0 if self.stale or not s else 0.0)
        if not s:
            return
        yield GaugeMetricFamily(f"{PREFIX}_engine_stats_age_seconds", "Age of the engine's metrics below",
                                value=max(0.0, time.monotonic() - self.taken_at))
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
        pages = GaugeMetricFamily(
            f"{PREFIX}_pool_pages", "KV pages by pool and state (used: in use or cached; free)",
            labels=["pool", "state"],
        )
        for pool, p in sorted(s["pages"].items()):
            pages.add_metric([pool, "used"], p["used"])
            pages.add_metric([pool, "free"], p["total"] - p["used"])
        yield pages
        if s.get("state_slots"):
            slots = GaugeMetricFamily(
                f"{PREFIX}_state_slots", "Recurrent-state slots by pool and state (snapshots: the tree's cached "
                "states; requests: running requests' working slots and captures; in_flight: L2 slots L3 writes "
                "read; free)", labels=["pool", "state"])
            for pool, p in sorted(s["state_slots"].items()):
                slots.add_metric([pool, "snapshots"], p["snapshots"])
                # L1: running requests' slots; L2: slots an L3 write reads or a free waits on
                slots.add_metric([pool, "requests" if pool == "device" else "in_flight"], p["used"] - p["snapshots"])
                slots.add_metric([pool, "free"], p["total"] - p["used"])
            yield slots
        storage = s.get("storage") or {}
        if storage:
            yield from storage_families(storage)
        if s.get("tenants"):
            yield from tenant_families(s["tenants"], s.get("bytes_per_page", {}))
        if s.get("speculative"):
            yield from speculative_families(s["speculative"])
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

        self.http_requests = Counter(
            f"{PREFIX}_http_requests", "HTTP requests answered, by route template, method and status",
            labelnames=("route", "method", "status"), registry=self.registry,
        )
        self.http_closed = Counter(
            f"{PREFIX}_http_connections_closed", "Client connections the server closed, by reason (header_timeout, "
            "body_timeout, body_idle_timeout: a request not sent in time, answered 408; ambiguous_framing: "
            "Transfer-Encoding with Content-Length, answered 400)", labelnames=("reason",), registry=self.registry,
        )
        self.http_duration = Histogram(
            f"{PREFIX}_http_request_duration_seconds", "HTTP request duration until its answer ended (streams: whole)",
            labelnames=("route", "method"), buckets=(*_LATENCY_BUCKETS, 120.0, 300.0), registry=self.registry,
        )

    def on_request(self, route: str, method: str, status: int, duration_s: float) -> None:
        """Called by serving.server.access_log once per request; labels already bounded."""
        self.http_requests.labels(route, method, str(status)).inc()
        self.http_duration.labels(route, method).observe(duration_s)

    def on_tokens(self, state: ReqState, new: int) -> None:
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

    def render(self, snapshot: dict[str, Any] | None, stall_s: float = 0.0) -> bytes:
        """The exposition text; ``snapshot``: the engine's Stats, None when it did not answer
        (the last one is served, marked stale)."""
        engine = self.engine
        if snapshot is not None:
            engine.snapshot, engine.taken_at = snapshot, time.monotonic()
        engine.stale, engine.stall_s = snapshot is None, stall_s
        return generate_latest(self.registry)
