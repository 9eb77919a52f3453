"""Driver for tests/test_drain.py; runs INSIDE a test network namespace.

A real mooncake_master, two real HiCache workers (fp32, Mooncake Store as their shared L3) and a
real router (in this process). Sessions and a pin lease live on worker A; A is drained through
the router (``/remove_worker?drain=true``); the sessions' next turns go to B, which serves the
previous context from L3, with the same greedy answers as a cold computation. Prints one JSON
line of findings. Usage: python tests/mooncake_drain.py MODEL_DIR WORK_DIR NS_ADDRESS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.config import RouterConfig  # noqa: E402
from router.embedded import RouterThread  # noqa: E402
from tests.mooncake_two_servers import Master, config  # noqa: E402
from tests.server_utils import ServerProcess  # noqa: E402

PS = 16
SESSIONS = 3


def gen(url: str, ids: list[int], sid: str | None = None, salt: str | None = None) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    if sid is not None:
        body["session_id"] = sid
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def prompt(i: int) -> list[int]:
    return [(i * 7919 + k * 131) % 40000 + 100 for k in range(90 + 7 * i)]


def main() -> None:
    model, work, address = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    master = Master(work / "master.log")
    master.start()
    cfg = config(work, address)
    args = ["--config", str(cfg), "--model-path", model, "--served-model-name", "tiny", "--dtype", "float32",
            "--hicache-storage-load-policy", "always_load"]
    a, b = ServerProcess(args), ServerProcess(args)
    a.start()
    b.start()
    out: dict = {}
    router = RouterThread(RouterConfig(worker_urls=(a.url,), health_check_interval_s=0.5)).start()
    try:
        r = router.url
        sids = [httpx.post(r + "/open_session", json={}, timeout=30).json() for _ in range(SESSIONS)]
        turn1 = [gen(r, prompt(i), sid) for i, sid in enumerate(sids)]
        out["turn1_workers_a"] = True  # the router had only A
        turn2 = [prompt(i) + t["output_ids"] + [500 + i, 501, 502, 503, 504] for i, t in enumerate(turn1)]
        # what A holds of each next turn: the previous context (prompt + answer, whole pages)
        held = []
        for ids in turn2:
            c = httpx.post(a.url + "/cache/lookup", json={"input_ids": ids}, timeout=30).json()["cached_tokens"]
            held.append(c["L1"] + c["L2"])
        out["held_on_a"] = held
        # cold references: the same prompts in a salted space of A's (nothing of them is cached there)
        refs = [gen(a.url, ids, salt="cold-ref") for ids in turn2]
        out["refs_cold"] = [x["meta_info"]["cached_tokens"] == 0 for x in refs]
        pin = httpx.post(r + "/cache/pin", json={"input_ids": prompt(0), "ttl_s": 600}, timeout=30)
        out["pin_status"] = pin.status_code
        lease = pin.json()["lease_id"]
        httpx.post(r + "/add_worker", params={"url": b.url}, timeout=30).raise_for_status()
        d = httpx.post(r + "/remove_worker", params={"url": a.url, "drain": "true"}, timeout=300)
        out["drain_status"] = d.status_code
        report = d.json()
        out["drain"] = report
        out["a_refuses"] = httpx.post(a.url + "/generate", json={"input_ids": prompt(0)}, timeout=30).status_code
        out["a_refusal_text"] = httpx.post(a.url + "/generate", json={"input_ids": prompt(0)}, timeout=30).text
        out["a_integrity"] = a.check_integrity()
        workers = httpx.get(r + "/list_workers", timeout=30).json()["workers"]
        out["workers_after"] = [w["url"] == b.url for w in workers]
        res = []
        for ids, sid in zip(turn2, sids, strict=True):
            resp = httpx.post(r + "/generate", timeout=120, json={
                "input_ids": ids, "session_id": sid,
                "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
            res.append({"status": resp.status_code, "worker": resp.headers.get("x-hicache-worker"),
                        **({"out": resp.json()["output_ids"],
                            "storage": resp.json()["meta_info"]["cached_tokens_details"].get("storage", 0),
                            "cached": resp.json()["meta_info"]["cached_tokens"]} if resp.status_code == 200 else
                           {"text": resp.text})})
        out["turn2"] = res
        out["same_as_cold"] = [x.get("out") == ref["output_ids"] for x, ref in zip(res, refs, strict=True)]
        out["unpin_status"] = httpx.delete(r + f"/cache/pin/{lease}", timeout=30).status_code
        out["b_integrity"] = b.check_integrity()["ok"]
    finally:
        router.stop()
        out["exit_codes"] = [s.stop() for s in (a, b)]
        out["a_log_tracebacks"] = "Traceback" in a.log()
        master.kill()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
