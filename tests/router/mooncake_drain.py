"""Driver for tests/router/test_drain.py; runs INSIDE a test network namespace.

A real mooncake_master, two real HiCache workers (fp32, Mooncake Store as their shared L3) and a
real router (in this process), all with API keys (``--api-keys-file``: tenants alice and bob).
Sessions (the default tenant's and one of alice's), a pin lease and a salted lease of alice's live
on worker A; A is drained through the router (``/remove_worker?drain=true``); the sessions' next
turns go to B, which serves the previous context from L3, with the same greedy answers as a cold
computation, and alice's lease is held on B as hers. Prints one JSON line of findings.
Usage: python tests/router/mooncake_drain.py MODEL_DIR WORK_DIR NS_ADDRESS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.mooncake_master import Master, config  # noqa: E402
from harness.server_utils import ServerProcess  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.embedded import RouterThread  # noqa: E402

PS = 16
SESSIONS = 3  # the default tenant's; then one of alice's
ADMIN_KEY, ALICE_KEY, BOB_KEY = "sk-admin-drain-1", "sk-alice-drain-1", "sk-bob-drain-1"
ADMIN, ALICE, BOB = ({"authorization": f"Bearer {k}"} for k in (ADMIN_KEY, ALICE_KEY, BOB_KEY))
ALICE_SALT = "alice-project"


def gen(url: str, ids: list[int], sid: str | None = None, salt: str | None = None, key: dict = ADMIN) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    if sid is not None:
        body["session_id"] = sid
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(url + "/generate", json=body, headers=key, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


BP_TOKENS = 144  # prompt(9): 153 tokens, 9 whole pages


def breakpoint_turn(url: str) -> dict:
    body = {"input_ids": prompt(9), "cache_control": {"type": "ephemeral"},
            "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    r = httpx.post(url + "/generate", json=body, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cache_control"]


def held(url: str, ids: list[int], key: dict, salt: str | None = None) -> int:
    """Leading tokens of ``ids`` on L1 or L2 of the worker at ``url``, in the key's (+ salt's) scope."""
    body = {"input_ids": ids, **({"cache_salt": salt} if salt else {})}
    c = httpx.post(url + "/cache/lookup", json=body, headers=key, timeout=30).json()["cached_tokens"]
    return c["L1"] + c["L2"]


def prompt(i: int) -> list[int]:
    return [(i * 7919 + k * 131) % 40000 + 100 for k in range(90 + 7 * i)]


def main() -> None:
    model, work, address = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    master = Master(work / "master.log")
    master.start()
    cfg = config(work, address)
    keys = work / "keys.yaml"
    keys.write_text(json.dumps({"salt_secret": "a-drain-test-secret-0123", "keys": {ALICE_KEY: "alice",
                                                                                      BOB_KEY: "bob"}}))
    args = ["--config", str(cfg), "--model-path", model, "--served-model-name", "tiny", "--dtype", "float32",
            "--hicache-storage-load-policy", "always_load", "--api-keys-file", str(keys)]
    a, b = ServerProcess(args, ADMIN_KEY), ServerProcess(args, ADMIN_KEY)
    a.start()
    b.start()
    out: dict = {}
    router = RouterThread(RouterConfig(worker_urls=(a.url,), health_check_interval_s=0.5, api_key=ADMIN_KEY,
                                       api_keys_file=str(keys))).start()
    try:
        r = router.url
        owners = [ADMIN] * SESSIONS + [ALICE]
        sids = [httpx.post(r + "/open_session", json={}, headers=k, timeout=30).json() for k in owners]
        turn1 = [gen(r, prompt(i), sid, key=k) for i, (sid, k) in enumerate(zip(sids, owners, strict=True))]
        out["turn1_workers_a"] = True  # the router had only A
        turn2 = [prompt(i) + t["output_ids"] + [500 + i, 501, 502, 503, 504] for i, t in enumerate(turn1)]
        # what A holds of each next turn: the previous context (prompt + answer, whole pages)
        out["held_on_a"] = [held(a.url, ids, k) for ids, k in zip(turn2, owners, strict=True)]
        # cold references: the same prompts in a salted space of A's (nothing of them is cached there)
        refs = [gen(a.url, ids, salt="cold-ref") for ids in turn2]
        out["refs_cold"] = [x["meta_info"]["cached_tokens"] == 0 for x in refs]
        pin = httpx.post(r + "/cache/pin", json={"input_ids": prompt(0), "ttl_s": 600}, headers=ADMIN, timeout=30)
        out["pin_status"] = pin.status_code
        lease = pin.json()["lease_id"]
        salted = prompt(7)  # alice's, in her ALICE_SALT space: cached, then pinned there
        gen(r, salted, salt=ALICE_SALT, key=ALICE)
        pin = httpx.post(r + "/cache/pin", json={"input_ids": salted, "cache_salt": ALICE_SALT, "ttl_s": 600},
                         headers=ALICE, timeout=30)
        out["salted_pin_status"] = pin.status_code
        alice_lease, out["salted_pinned"] = pin.json()["lease_id"], pin.json()["pinned_tokens"]
        out["bp_before"] = breakpoint_turn(r)  # a cache_control breakpoint's lease (default tenant)
        httpx.post(r + "/add_worker", params={"url": b.url}, headers=ADMIN, timeout=30).raise_for_status()
        d = httpx.post(r + "/remove_worker", params={"url": a.url, "drain": "true"}, headers=ADMIN, timeout=300)
        out["drain_status"] = d.status_code
        report = d.json()
        out["drain"] = report
        refused = httpx.post(a.url + "/generate", json={"input_ids": prompt(0)}, headers=ADMIN, timeout=30)
        out["a_refuses"], out["a_refusal_text"] = refused.status_code, refused.text
        out["a_integrity"] = a.check_integrity()
        workers = httpx.get(r + "/list_workers", headers=ADMIN, timeout=30).json()["workers"]
        out["workers_after"] = [w["url"] == b.url for w in workers]
        # alice's salted lease on B: her prefix is on L2 there (prefetched, pinned), in her salted space
        out["salted_on_b"] = held(b.url, salted, ALICE, ALICE_SALT)
        res = []
        for ids, sid, k in zip(turn2, sids, owners, strict=True):
            resp = httpx.post(r + "/generate", timeout=120, headers=k, json={
                "input_ids": ids, "session_id": sid,
                "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
            res.append({"status": resp.status_code, "worker": resp.headers.get("x-hicache-worker"),
                        **({"out": resp.json()["output_ids"],
                            "storage": resp.json()["meta_info"]["cached_tokens_details"].get("storage", 0),
                            "cached": resp.json()["meta_info"]["cached_tokens"]} if resp.status_code == 200 else
                           {"text": resp.text})})
        out["turn2"] = res
        out["same_as_cold"] = [x.get("out") == ref["output_ids"] for x, ref in zip(res, refs, strict=True)]
        out["unpin_status"] = httpx.delete(r + f"/cache/pin/{lease}", headers=ADMIN, timeout=30).status_code
        # the re-homed breakpoint lease is B's breakpoint now: the same breakpoint refreshes it (no new lease)
        out["bp_after"] = breakpoint_turn(r)
        leases = httpx.post(b.url + "/drain", headers=ADMIN, timeout=120).json()["leases"]
        out["bp_leases_on_b"] = [x["breakpoint"] for x in leases if x["input_ids"] == prompt(9)[:BP_TOKENS]]
        # alice's re-homed lease is hers on B: bob cannot release it, she can (by its old id)
        out["salted_unpin_by_bob"] = httpx.delete(r + f"/cache/pin/{alice_lease}", headers=BOB, timeout=30).status_code
        out["salted_unpin"] = httpx.delete(r + f"/cache/pin/{alice_lease}", headers=ALICE, timeout=30).status_code
        out["b_integrity"] = b.check_integrity()["ok"]
    finally:
        router.stop()
        out["exit_codes"] = [s.stop() for s in (a, b)]
        out["a_log_tracebacks"] = "Traceback" in a.log()
        master.kill()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
