"""PD disaggregation end to end: 1 prefill + 1 decode server (SmolLM2, fp32) behind the real
router, each transfer backend; greedy answers token-identical to a colocated server for
single prompts, batches, streams and concurrent requests; with Mooncake also sessions over
three turns (later turns hit the prefill side's cache, and the decode side reuses its own
prefix pages) and L3: the decode side publishes prompt + answer to Mooncake Store, and the
next turn's prefill (its own cache flushed) loads the answer's KV from there.
``check_integrity()`` on both PD servers after every scenario. The cluster runs in
harness/pd_cluster.py (in a network namespace for Mooncake)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.netns import NetNS, unavailable_reason
from harness.server_utils import kill_tree

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DRIVER = str(ROOT / "harness" / "pd_cluster.py")


def _findings(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, out[-4000:]
    res = json.loads(lines[-1])
    assert "error" not in res, json.dumps(res, indent=1)[-6000:]
    return res


def _check_common(res: dict) -> None:
    assert all(res["single_same"]), res
    assert res["batch_same"] and res["stream_same"] and res["concurrent_same"], res
    assert res["integrity_single"] and res["integrity_batch"], res
    p, d = res["prefill_pd"], res["decode_pd"]
    assert p["sent"] > 0 and p["sent"] == d["received"] and p["bytes_sent"] == d["bytes_received"], res
    assert p["send_failed"] == 0 and d["failed"] == 0, res
    assert p["parked"] == p["sending"] == d["registered"] == d["quarantined"] == 0, res  # nothing held
    assert res["exit_codes"] == [0, 0, 0], res


def test_pd_mooncake_with_sessions_and_l3(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason or not (Path(sys.executable).parent / "mooncake_master").exists():
        pytest.skip(reason or "mooncake_master is not installed")
    ns = NetNS("hcpd")
    ns.create()
    proc = None
    try:
        proc = ns.popen([sys.executable, DRIVER, "mooncake", str(tmp_path), ns.address, "--l3"],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc is not None:
            kill_tree(proc)
        ns.delete()
    res = _findings(out)
    _check_common(res)
    turns = res["session_turns"]
    assert all(t["same"] for t in turns), turns
    assert turns[0]["cached_tokens"] == 0, turns
    for prev, t in zip(turns, turns[1:], strict=False):  # each turn finds the previous prompt in the prefill cache
        assert t["cached_tokens"] >= prev["prompt_tokens"] - 16, turns
    assert res["decode_pd"]["pages_reused"] > 0, res  # incremental transfer: the decode side's radix cache
    assert res["integrity_session"] and res["integrity_l3"], res
    assert res["l3_same"], res
    # the whole first prompt and the answer's full pages came from L3 after the prefill side forgot them
    assert res["l3_storage_tokens"] > res["l3_prompt_first_tokens"], res


def test_pd_nixl(tmp_path: Path) -> None:
    try:
        from serving.disagg.transport_nixl import _api

        _api()
    except Exception as e:  # noqa: BLE001 - any import failure is a skip reason
        pytest.skip(f"NIXL is not installed (make setup installs nixl-cu12): {e}")
    env = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm"), "UCX_NET_DEVICES": "lo"}
    proc = subprocess.Popen([sys.executable, DRIVER, "nixl", str(tmp_path), "127.0.0.1", "--quick"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_tree(proc)
    _check_common(_findings(out))
