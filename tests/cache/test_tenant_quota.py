"""Per-tenant soft quotas through the real server: a tenant flooding L1 evicts its own pages
first, so another tenant keeps its hit; without a quota the same flood evicts the other
tenant's prefix (the control). Per-tenant counters in /metrics; the ledger's integrity holds."""

from __future__ import annotations

import re

import httpx
import pytest
import yaml

from harness.server_utils import ROOT, running_server
from hicache.hiradix.quota import TenantLedger

KEYS = {"keys": {"sk-alice-0001": {"tenant": "alice", "quota_pages": {"L1": 12}},
                 "sk-bob-00001": "bob", "sk-carol-001": "carol"}}
BOB = [(5 * i + 1) % 400 + 20 for i in range(70)]


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quota")
    (tmp / "keys.yaml").write_text(yaml.safe_dump(KEYS))
    args = ["--config", str(ROOT / "configs" / "l1.yaml"), "--model-path", str(tiny_chat_model),
            "--max-total-tokens", "1024", "--context-length", "512", "--api-keys-file", str(tmp / "keys.yaml")]
    with running_server(args, api_key="admin-key-0001") as s:
        yield s


def gen(server, key: str, ids: list[int]) -> int:
    r = httpx.post(server.url + "/generate", headers={"Authorization": f"Bearer {key}"}, timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


def flood(server, key: str, n: int = 20) -> None:
    for j in range(n):  # 20 distinct prompts of 5 pages each: 100 pages through a 64-page L1
        gen(server, key, [(j * 37 + 11 * i) % 450 + 30 for i in range(76)])


def metric(server, name: str, **labels) -> float:
    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{want}\}} ([0-9.e+]+)$", text, re.M)
    assert m, f"{name}{{{want}}} not in /metrics"
    return float(m.group(1))


def test_flood_without_quota_evicts_the_other_tenant(server):
    assert gen(server, "sk-bob-00001", BOB) == 0
    assert gen(server, "sk-bob-00001", BOB) == 64
    flood(server, "sk-carol-001")
    assert gen(server, "sk-bob-00001", BOB) == 0  # LRU took bob's pages: the flood is strong enough
    server.check_integrity()


def test_flood_within_quota_keeps_the_other_tenants_hit(server):
    r = httpx.post(server.url + "/flush_cache", headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text
    assert gen(server, "sk-bob-00001", BOB) == 0
    flood(server, "sk-alice-0001")
    assert gen(server, "sk-bob-00001", BOB) == 64  # alice, over her L1 quota, evicted her own pages
    body = server.check_integrity()
    assert body["ok"], body
    assert metric(server, "hicache_tenant_quota_pages", tenant="alice", tier="device") == 12
    assert metric(server, "hicache_tenant_requests_total", tenant="alice") == 20
    assert metric(server, "hicache_tenant_cache_hit_tokens_total", tenant="bob", tier="device") >= 128
    assert metric(server, "hicache_tenant_pages", tenant="bob", tier="device") >= 4
    assert metric(server, "hicache_tenant_bytes", tenant="bob", tier="device") > 0


def test_ledger_snapshot_bounds_labels():
    led = TenantLedger(16, {f"t{i}": {"device": 1} for i in range(300)})
    snap = led.snapshot(max_tenants=256)
    assert len(snap) == 258 and "_other" in snap and "default" in snap
    with pytest.raises(ValueError):
        TenantLedger(16, {"a": {"L1": 1}})


def test_tenant_metrics_follow_prometheus_rules():
    from prometheus_client.parser import text_string_to_metric_families

    from serving.server.metrics import ServerMetrics

    led = TenantLedger(16, {"alice": {"device": 8}})
    led.record("alice", 100, {"device": 64, "host": 0, "storage": 0})
    led.record(None, 10, {"device": 0})
    snap = {"prompt_tokens": 110, "cached_tokens": 64, "cached_by_tier": {"device": 64}, "generated_tokens": 1,
            "retractions": 0, "forward_passes": 1, "running": 0, "waiting": 0, "sessions": 0,
            "pages": {"device": {"total": 64, "used": 4}}, "storage": {}, "tenants": led.snapshot(),
            "bytes_per_page": {"device": 1024}}
    fams = {f.name: f for f in text_string_to_metric_families(ServerMetrics().render(snap).decode())}
    for name, kind in (("hicache_tenant_pages", "gauge"), ("hicache_tenant_bytes", "gauge"),
                       ("hicache_tenant_quota_pages", "gauge"), ("hicache_tenant_requests", "counter"),
                       ("hicache_tenant_prompt_tokens", "counter"), ("hicache_tenant_cache_hit_tokens", "counter")):
        assert fams[name].type == kind, name
    hits = {(s.labels["tenant"], s.labels["tier"]): s.value for s in fams["hicache_tenant_cache_hit_tokens"].samples
            if s.name.endswith("_total")}
    assert hits[("alice", "device")] == 64 and {s.labels["tenant"] for s in fams["hicache_tenant_requests"].samples} \
        == {"alice", "default"}
