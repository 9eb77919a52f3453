"""Driver for tests/server/test_server_mooncake.py; runs INSIDE a test network namespace.

Starts a real mooncake_master and two real HiCache servers sharing it, runs the scenario
and prints one JSON line of findings on stdout. Usage:
    python tests/server/mooncake_two_servers.py MODEL_DIR WORK_DIR NS_ADDRESS
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from harness.mooncake_master import Master, config  # noqa: E402
from harness.server_utils import ServerProcess  # noqa: E402


def metric(s: ServerProcess, name: str, label: str) -> float:
    text = httpx.get(s.url + "/metrics", timeout=30).text
    m = re.search(rf'^{name}\{{[^}}]*"{label}"[^}}]*\}} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def gauge(s: ServerProcess, name: str) -> float:
    text = httpx.get(s.url + "/metrics", timeout=30).text
    m = re.search(rf"^{name}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def running(s: ServerProcess) -> float:
    return gauge(s, "hicache_num_running_reqs")


def gen(s: ServerProcess, ids: list[int], new_tokens: int = 4) -> tuple[int, list[int] | None, int]:
    r = httpx.post(s.url + "/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens,
                                              "ignore_eos": new_tokens > 4}})
    if r.status_code != 200:
        return r.status_code, None, 0
    body = r.json()
    return 200, body["output_ids"], body["meta_info"]["cached_tokens_details"].get("storage", 0)


def block_until(s: ServerProcess, ids: list[int], release: threading.Event) -> tuple[int, int, str]:
    """A long streamed request that keeps C's one running slot busy until ``release`` is set (then the
    stream is closed: the server aborts it), or it ends on its own; (status, lines read, the last line)."""
    body = {"input_ids": ids, "stream": True,  # most of the 4,096-token context: several seconds
            "sampling_params": {"temperature": 0, "max_new_tokens": 3900, "ignore_eos": True}}
    n, last = 0, ""
    with httpx.stream("POST", s.url + "/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            n, last = n + 1, line or last
            if release.is_set():
                break
        return r.status_code, n, last[-200:]


def prompts(seed: int, n: int) -> list[list[int]]:
    return [[(seed * 7919 + p * 131 + i * 17) % 40000 + 100 for i in range(96 + p)] for p in range(n)]


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.3)
    return False


def main() -> None:
    model, work, address = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    master = Master(work / "master.log")
    master.start()
    cfg = config(work, address)
    args = ["--config", str(cfg), "--model-path", model, "--served-model-name", "tiny"]
    # A writes; B and C read what A computed, under the two other prefetch policies
    # (the config's own policy, wait_complete, is A's). C runs one request at a time, so
    # queued requests' best-effort prefetches have time to land.
    a = ServerProcess(args)
    b = ServerProcess([*args, "--hicache-storage-prefetch-policy", "timeout"])
    c = ServerProcess([*args, "--hicache-storage-prefetch-policy", "best_effort", "--max-running-requests", "1"])
    for srv in (a, b, c):
        srv.start()
    out: dict = {}
    try:
        p = prompts(1, 6)
        ref = [gen(a, x)[1] for x in p]  # A computes...
        [gen(a, x) for x in p]  # ...and hits its own pages: backed up to L2, written to Mooncake
        out["a_stored"] = wait_for(lambda: metric(a, "hicache_storage_events_total", "stored") > 0, 20)
        res_b = [gen(b, x) for x in p]
        out["b_same_output"] = [r[1] for r in res_b] == ref
        out["b_storage_hit_tokens"] = sum(r[2] for r in res_b)
        release = threading.Event()
        with ThreadPoolExecutor(len(p) + 1) as pool:  # a long request runs first: the others queue
            blocker = pool.submit(block_until, c, prompts(3, 1)[0], release)  # while their best-effort
            wait_for(lambda: running(c) > 0 or blocker.done(), 20)  # prefetches land (then it stops)
            queued = [pool.submit(gen, c, x) for x in p]
            # their fetches read L3 (pages verified into L2) while the blocker still runs (pages_prefetched
            # counts them only once their requests are admitted)
            read = wait_for(lambda: blocker.done() or metric(c, "hicache_storage_events_total", "hits") > 0, 60)
            out["c_blocker_ended_early"] = blocker.done()
            if blocker.done():  # (why: its status, lines, last line)
                out["c_blocker"] = blocker.result()
            out["c_prefetched_while_queued"] = read and not out["c_blocker_ended_early"]
            release.set()
            res_c = [f.result() for f in queued]
            blocker.result()
        out["c_same_output"] = [r[1] for r in res_c] == ref
        out["c_storage_hit_tokens"] = sum(r[2] for r in res_c)
        out["c_integrity"] = c.check_integrity()["ok"]
        out["c_exit"] = c.stop()
        # master killed in the middle of a load on both servers: no request may fail
        q = prompts(2, 8)
        with ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(gen, srv, x) for x in q for srv in (a, b)]
            time.sleep(0.5)
            master.kill()
            statuses = [f.result()[0] for f in futs]
        statuses += [gen(srv, x)[0] for x in prompts(4, 2) for srv in (a, b)]  # with the master gone
        out["statuses_during_master_kill"] = statuses
        out["healthy_after_kill"] = all(httpx.get(s.url + "/health", timeout=10).status_code == 200 for s in (a, b))
        out["errors_counted"] = sum(metric(srv, "hicache_storage_events_total", f"backend_{k}")
                                    for srv in (a, b) for k in ("errors", "timeouts", "unavailable"))
        master.start()  # it comes back (empty: the old objects died with it)
        attempt = iter(range(100, 200))

        def resumed() -> bool:
            # fresh prompts each attempt: a prompt B already computed itself (while its store
            # was still reconnecting) would hit B's own L1 from then on, never L3
            r = prompts(next(attempt), 3)
            before = metric(a, "hicache_storage_events_total", "stored")
            for x in r:
                gen(a, x)
                gen(a, x)  # a hit: backed up to L2 and written on to Mooncake
            if not wait_for(lambda: metric(a, "hicache_storage_events_total", "stored") > before, 5):
                return False
            return sum(gen(b, x)[2] for x in r) > 0

        out["hits_resume"] = wait_for(resumed, 60)
        out["integrity"] = [s.check_integrity()["ok"] for s in (a, b)]
    finally:
        out["exit_codes"] = [s.stop() for s in (a, b)]
        if c.proc is not None and c.proc.poll() is None:
            c.stop()
        master.kill()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
