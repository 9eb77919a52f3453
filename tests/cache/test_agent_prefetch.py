"""An agent's tool call outlives the L1 lifetime of its KV under load; a /cache/prefetch before it
resumes (and a session that keeps its KV on L2 while idle) makes its next turn start at L1
speed. SmolLM2 on the real server, in int4 as ``make serve`` runs it; the TTFTs are printed (run
with -s), the assertions are on where each turn's KV came from (timing goals live in bench/)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from harness.model_utils import smollm2_path
from harness.server_utils import running_server

pytestmark = pytest.mark.slow

AGENT, LOAD = "sk-agent-0001", "sk-load-00001"
CONFIG = {"cache": {"page_size": 16, "hicache_ratio": 3.0, "hicache_write_policy": "write_through"},
          "scheduler": {"max_running_requests": 8, "chunked_prefill_size": 1024}}
PS = 16


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 104729 * i) % 30000 + 200 for i in range(n)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent")
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(CONFIG))
    (tmp / "keys.yaml").write_text(yaml.safe_dump({"keys": {AGENT: "agent", LOAD: "load"}}))
    args = ["--config", str(tmp / "cfg.yaml"), "--model-path", str(smollm2_path()), "--quantization", "int4",
            "--max-total-tokens", "3072",
            "--context-length", "2048", "--api-keys-file", str(tmp / "keys.yaml")]
    with running_server(args, api_key="admin-key-0001") as s:
        yield s


def call(server, key: str, path: str, body: dict) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = httpx.post(server.url + path, headers={"Authorization": f"Bearer {key}"}, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json(), time.perf_counter() - t0


def turn(server, prompt: list[int], sid: str | None, new_tokens: int = 1) -> tuple[dict, float]:
    """A turn's first token: /generate with one new token (its latency is the TTFT)."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}}
    if sid is not None:
        body["session_id"] = sid
    out, dt = call(server, AGENT, "/generate", body)
    return out, dt


def test_prefetch_before_resuming_gives_l1_ttft(server):
    system, tool_result = 1200, 48
    # reference: a turn whose whole prefix is on L1 (resumed at once, no load)
    ref = ids(1, system)
    first, _ = turn(server, ref, None, new_tokens=8)
    ref2 = ref + first["output_ids"] + ids(2, tool_result)
    out, ttft_l1 = turn(server, ref2, None)
    full = (len(ref) + 8) // PS * PS
    assert out["meta_info"]["cached_tokens_details"]["device"] >= full - PS

    # two agents start: A keeps its KV on L2 while idle (retention) and prefetches before resuming; B does neither
    sid, _ = call(server, AGENT, "/open_session", {"retention": {"demote_on_idle": True, "ttl_s": 600}})
    a1, b1 = ids(3, system), ids(4, system)
    a_out, _ = turn(server, a1, sid, new_tokens=8)
    b_out, _ = turn(server, b1, None, new_tokens=8)
    a_prefix, b_prefix = a1 + a_out["output_ids"], b1 + b_out["output_ids"]

    # both call a tool; meanwhile another tenant's load pushes their KV out of L1
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda j: call(server, LOAD, "/generate", {
            "input_ids": ids(100 + j, 1400), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}), range(6)))
    during, _ = call(server, AGENT, "/cache/lookup", {"input_ids": a_prefix})
    assert during["cached_tokens"]["L1"] == 0, during  # the tool call outlived A's KV on L1 ...
    assert during["cached_tokens"]["L2"] >= full - PS, during  # ... which its session kept on L2

    # A prefetches while its tool still runs, then resumes; B just resumes
    pre, prefetch_s = call(server, AGENT, "/cache/prefetch", {"input_ids": a_prefix})
    assert pre["cached_tokens_details"]["host"] > 0, pre  # loaded from L2, not recomputed
    a2, ttft_a = turn(server, a_prefix + ids(5, tool_result), sid)
    b2, ttft_b = turn(server, b_prefix + ids(6, tool_result), None)
    a_tiers, b_tiers = a2["meta_info"]["cached_tokens_details"], b2["meta_info"]["cached_tokens_details"]
    assert a_tiers["device"] >= full - PS, a_tiers  # A's next turn found its whole prefix on L1
    assert b_tiers["device"] < full - PS, b_tiers  # B's had to load or recompute it

    print(f"\nagent resume TTFT ({len(a_prefix) + tool_result} prompt tokens, SmolLM2, CPU):\n"
          f"  L1 hit, no load (reference)       {ttft_l1 * 1e3:8.1f} ms\n"
          f"  after prefetch (A)                {ttft_a * 1e3:8.1f} ms   tiers {a_tiers}\n"
          f"  without prefetch (B)              {ttft_b * 1e3:8.1f} ms   tiers {b_tiers}\n"
          f"  the prefetch itself (during the tool call) {prefetch_s * 1e3:.1f} ms")
    body = server.check_integrity()
    assert body["ok"], body
