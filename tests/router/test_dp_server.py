"""`hicache serve --dp-size 2` (CPU): one command starts two replicas and the cache-aware router;
on shared-prefix groups the router's cached share is at least 90 % of a single replica's, and
the replicas share one L3 (a prefix written by one is a storage hit on the other). The DP server
runs with ``--api-key`` and ``--api-keys-file``: its router takes the tenants' keys as the replicas
do (issue 42: it was started without the keys file, so a tenant's key was a 401 at the router)."""

from __future__ import annotations

import random
import socket
import time

import httpx
import pytest
import yaml

from harness.server_utils import ServerProcess, free_port

ROUTER_READY = "The router is ready to route!"


class DPServer(ServerProcess):
    """``hicache serve --dp-size N``: ready when the router says so."""

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.strip() == ROUTER_READY:
                self.ready.set()


def _config(tmp_path, model, l3: str) -> str:
    cfg = {"model": {"model_path": str(model)},
           "cache": {"page_size": 4, "hicache_ratio": 2.0, "hicache_write_policy": "write_through",
                     "hicache_mem_layout": "page_first", "hicache_storage_backend": "lmdb",
                     "hicache_storage_backend_extra_config": {"path": str(tmp_path / l3), "capacity_gb": 0.05,
                                                               "initial_map_mb": 1},
                     "hicache_storage_prefetch_policy": "wait_complete"},
           "scheduler": {"max_total_tokens": 4096}}
    path = tmp_path / f"{l3}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _groups() -> list[str]:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "lambda", "theta", "zeta"]
    out = []
    for g in range(6):
        prefix = f"Group {g}: " + " ".join(rng.choice(words) for _ in range(120))
        out += [f"{prefix} question {i}: " + " ".join(rng.choice(words) for _ in range(6)) for i in range(4)]
    return out


ADMIN, TENANT = "dp-admin-key-01", "sk-dp-tenant-01"


def _cached_share(url: str, prompts: list[str], headers: dict[str, str] | None = None) -> float:
    cached = total = 0
    for p in prompts:
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": p, "max_tokens": 2, "temperature": 0},
                       timeout=120, headers=headers)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        total += usage["prompt_tokens"]
        cached += usage["prompt_tokens_details"]["cached_tokens"]
    return cached / total


@pytest.mark.slow
def test_dp2_router_cached_share_and_shared_l3(tiny_chat_model, tmp_path):
    prompts = _groups()
    single = ServerProcess(["--config", _config(tmp_path, tiny_chat_model, "l3-single"),
                            "--served-model-name", "m"])
    single.start()
    try:
        share_single = _cached_share(single.url, prompts)
    finally:
        assert single.stop() == 0
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": {TENANT: "t"}}))
    dp = DPServer(["--config", _config(tmp_path, tiny_chat_model, "l3-dp"), "--served-model-name", "m",
                   "--dp-size", "2", "--api-keys-file", str(keys)], api_key=ADMIN)
    dp.start(timeout=300)
    h = {"Authorization": f"Bearer {TENANT}"}
    try:
        workers = [w["url"] for w in httpx.get(dp.url + "/list_workers", timeout=10, headers=dp.headers).json()[
            "workers"]]
        assert len(workers) == 2
        share_dp = _cached_share(dp.url, prompts, h)  # a tenant's key, through the router
        assert share_dp >= 0.9 * share_single, (share_dp, share_single)
        # one L3: a prompt computed on replica 0 is read from storage by replica 1
        text = "Shared store check: " + "lorem ipsum dolor " * 40
        for _ in range(2):  # the second request hits the first's pages: backed up to L2, written on to L3
            r = httpx.post(workers[0] + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}},
                           timeout=60, headers=h)
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60  # the write-back to L3 runs in the background: until replica 1 sees it
        while time.monotonic() < deadline and httpx.post(workers[1] + "/cache/lookup", json={"prompt": text},
                                                          timeout=30, headers=h).json()["cached_tokens"]["L3"] == 0:
            time.sleep(0.2)
        r = httpx.post(workers[1] + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}},
                       timeout=60, headers=h)
        assert r.json()["meta_info"]["cached_tokens_details"]["storage"] > 0, r.json()["meta_info"]
    finally:
        code = dp.stop(timeout=120)
    assert code == 0, dp.log()[-3000:]
    print(f"cached share: single replica {share_single:.3f}, --dp-size 2 behind the router {share_dp:.3f}")


def test_replica_ports_skip_busy_ones_and_stay_held_for_the_replicas():
    from serving.launch.dp import replica_ports

    busy = socket.socket()
    for _ in range(100):  # a base whose next port this test can hold itself: a port another socket had
        base = free_port()  # (e.g. in TIME_WAIT) may refuse a plain bind yet be free for the replicas
        try:
            busy.bind(("127.0.0.1", base + 1))
            break
        except OSError:
            continue
    busy.listen()
    ports, holds = replica_ports(base, 2)
    try:
        assert base + 1 < ports[0] < ports[1], ports
        other = socket.socket()
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", ports[0]))  # held: no other process takes it meanwhile
        other.close()
        replica = socket.socket()  # ... but the replica's listening socket binds it
        replica.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        replica.bind(("127.0.0.1", ports[0]))
        replica.listen()
        replica.close()
    finally:
        for s in (busy, *holds):
            s.close()
