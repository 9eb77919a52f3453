"""Driver for tests/engine/test_engine_state_l3.py's Mooncake case; runs INSIDE a test network namespace.

Starts a real mooncake_master and two real HiCache servers sharing it with a tiny model with state
layers (or sliding windows: ``"state": false`` in the cases): A serves conversations (first turns, then
second turns: their hits write pages and state snapshots on to Mooncake); B, fresh, serves the second
turns again from what A stored. Prints one JSON line: each server's output tokens and log-probabilities,
B's storage hits, counters. Usage:
    python tests/engine/mooncake_state_two_servers.py MODEL_DIR WORK_DIR CASES_JSON NS_ADDRESS
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.mooncake_master import Master, config  # noqa: E402
from harness.server_utils import ServerProcess  # noqa: E402


def gen(s: ServerProcess, ids: list[int], new: int) -> dict:
    r = httpx.post(s.url + "/generate", timeout=120, json={
        "input_ids": ids, "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}})
    r.raise_for_status()
    body = r.json()
    meta = body["meta_info"]
    return {"ids": body["output_ids"], "logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]],
            "storage": meta["cached_tokens_details"].get("storage", 0)}


def storage_stats(s: ServerProcess) -> dict:
    info = httpx.get(s.url + "/get_server_info", timeout=30).json()
    return info["internal_states"][0]["storage"]


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.3)
    return False


def main() -> None:
    model, work, cases, address = sys.argv[1], Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text()), sys.argv[4]
    master = Master(work / "master.log")
    master.start()
    cfg = config(work, address)
    args = ["--config", str(cfg), "--model-path", model, "--served-model-name", "tiny", "--page-size", "4"]
    a, b = ServerProcess(args), ServerProcess(args)
    for srv in (a, b):  # both up first: Mooncake keeps a value in the segment of a client that is alive
        srv.start()
    out: dict = {}
    try:
        new = cases["new"]
        out["a_first"] = [gen(a, p, new)["ids"] for p in cases["first"]]
        out["a_second"] = [gen(a, p, new) for p in cases["second"]]  # hits: backed up, written on with snapshots
        n = len(cases["first"])
        if cases.get("state", True):
            out["a_snapshots_stored"] = wait_for(lambda: storage_stats(a).get("state_stored", 0) >= n, 30)
        else:  # a model without state layers (sliding windows): its pages are what travels
            out["a_pages_stored"] = wait_for(lambda: storage_stats(a).get("stored", 0) > 0
                                             and storage_stats(a).get("write_pages_in_flight", 0) == 0, 30)
        out["a_integrity"] = a.check_integrity()["ok"]
        out["b_second"] = [gen(b, p, new) for p in cases["second"]]
        out["b_stats"] = {k: v for k, v in storage_stats(b).items() if k.startswith("state_")}
        out["b_integrity"] = b.check_integrity()["ok"]
        out["exit_codes"] = [srv.stop() for srv in (b, a)]
    finally:
        for srv in (a, b):
            srv.stop()
        master.kill()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
