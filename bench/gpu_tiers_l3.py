"""L3 after a restart, for bench/gpu_tiers.py's ttft section (see that file): the warm L3 hit of a
restarted engine (L2 pinned), the first requests of an engine that does not wait for its L2
pinning, the write-back's rate, and all of these again with Mooncake Store as L3.

Mooncake (``--l3-backends lmdb,mooncake``): a real ``mooncake_master`` on 127.0.0.1, in a network
namespace of its own where one can be made (root and ``ip``: harness/netns.py), else directly on
the host (the H200 host has no ``ip``; it is isolated). Every Mooncake process binds its transfer
engine to 127.0.0.1 (``MC_TCP_BIND_ADDRESS``). A store keeps values in the segments its clients
mount and loses them with the client, so a *holder* process mounts the segment and the engines
mount none (``global_segment_mb: 0``): the values outlive an engine's restart, as they outlive a
server's restart beside other servers. The engines run in a child process (this file run as
``child``) inside the namespace; its JSON is the parent's ``res["mooncake"]``.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_model import rand_prompts  # noqa: E402
from bench.gpu_tiers_sections import ONE, close, make_engine, server_warmup, tier_gbps, timed  # noqa: E402

RESTART_REQUESTS = 8  # the "each of the first 8 requests after a restart"
CHILD_TIMEOUT_S = 300
BIND_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}  # the transfer engine listens on loopback (not a LAN address)


def stored_prompts(args) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(timed prompts, every stored prompt (the timed ones first, then enough more for the first
    RESTART_REQUESTS after a restart), warm-up prompts): the same in the parent and the child."""
    prompts = rand_prompts(args.prompts, args.context, args.vocab, seed=21)
    extra = rand_prompts(max(0, RESTART_REQUESTS - args.prompts), args.context, args.vocab, seed=25)
    return prompts, prompts + extra, rand_prompts(4, args.context, args.vocab, seed=22)


def l1_tokens(args) -> int:
    """L1 of the ttft engines: every stored prompt and two warm-ups."""
    return (max(args.prompts, RESTART_REQUESTS) + 2) * (args.context + 64)


def persist(eng, res: dict) -> None:
    """Every cached page written on to L3 (as a server's shutdown does); the write rates."""
    before = eng.core.storage.tier.stats()
    t0 = time.perf_counter()
    eng.core.tree.backup_all()
    eng.core.req_cache.flush_transfers()
    eng.core.storage.persist_all()
    res["persist_wall_s"] = time.perf_counter() - t0
    res["l3_write_gbps"] = tier_gbps(eng, {}, "write")  # every write of this engine (write-through ones too)
    res["l3_persist_write_gbps"] = tier_gbps(eng, before, "write")


def l3_warm(res: dict, args, model_dir: str, l3, prompts, warm, ref) -> None:
    """A restarted engine, L2 pinned, loading every L3 hit: TTFT of each prompt (median)."""
    eng = make_engine(args, model_dir, l3, max_total_tokens=l1_tokens(args), hicache_size=args.l2_gb,
                      hicache_storage_load_policy="always_load")
    for p in warm[:2]:
        eng.generate(input_ids=p, sampling_params=ONE)
    before = eng.core.storage.tier.stats()
    times, same = [], True
    for i, p in enumerate(prompts):
        dt, out = timed(eng, p)
        times.append(dt)
        same &= out["output_ids"] == ref[i]
        assert out["meta_info"]["cached_tokens_details"]["storage"] > 0, out["meta_info"]
    res["ttft_l3_warm_s"] = statistics.median(times)
    res["l3_warm_same_tokens"] = same
    res["l3_warm_read_gbps"] = tier_gbps(eng, before, "read")
    res["l3_read_threads"] = eng.core.storage.tier.read_threads
    close(eng)


def first_after_restart(res: dict, args, model_dir: str, l3, stored) -> None:
    """An engine restarted on the store that serves at once (its L2 still pinning in the
    background; the engine's default load policy and a server's one-token warm-up, as a server
    starts): TTFT of each of the first RESTART_REQUESTS returning prompts."""
    eng = make_engine(args, model_dir, l3, wait_pinned=False, max_total_tokens=l1_tokens(args),
                      hicache_size=args.l2_gb)
    server_warmup(eng)
    host = eng.core.host_pool
    rows = []
    for p in stored[:RESTART_REQUESTS]:
        since = time.perf_counter() - eng.started_at
        pinning = bool(host is not None and host.growing)
        dt, out = timed(eng, p)
        meta = out["meta_info"]
        rows.append({"ttft_s": dt, "since_start_s": round(since, 3), "l2_pinning": pinning,
                     "cached": meta["cached_tokens_details"], "l3_decision": meta.get("l3_decision")})
    res["ttft_l3_after_restart_s"] = [r["ttft_s"] for r in rows]
    res["l3_after_restart"] = rows
    close(eng)


def fractions(res: dict, recompute_s: float) -> None:
    """The after-restart TTFTs as fractions of recompute."""
    res["ttft_l3_after_restart_x_recompute"] = [t / recompute_s for t in res["ttft_l3_after_restart_s"]]
    res["ttft_l3_after_restart_max_x_recompute"] = max(res["ttft_l3_after_restart_x_recompute"])


# -- Mooncake Store as L3 ------------------------------------------------------------------------
def unavailable() -> str | None:
    """Why Mooncake cannot be measured here, or None."""
    from harness.netns import MooncakeMaster

    if MooncakeMaster.binary() is None:
        return "mooncake_master is not installed"
    r = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True,
                       timeout=120, check=False)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        return f"mooncake.store does not import ({lines[-1] if lines else r.returncode})"
    return None


class _Host:
    """No namespace: processes start on the host (what harness.netns.MooncakeMaster asks of one)."""

    name, address = "host", "127.0.0.1"

    @staticmethod
    def popen(argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(argv, **kw)

    @staticmethod
    def wait_port(port: int, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                time.sleep(0.1)
        return False

    def delete(self) -> None:
        pass


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def mooncake_l3(args, model_dir: str, work: str, bytes_per_token: int) -> dict | str:
    """The L3 warm TTFT and the first requests after a restart with Mooncake Store as L3; a
    string ``n/a: <reason>`` when it cannot run here."""
    from harness.netns import MooncakeMaster, NetNS
    from harness.netns import unavailable_reason as netns_unavailable

    why = unavailable()
    if why:
        return f"n/a: {why}"
    ns, where = _Host(), "on the host (no network namespace: {})"
    reason = netns_unavailable()
    if reason is None:
        try:
            ns, where = NetNS("hcg").create(), "in a network namespace of its own"
        except RuntimeError as e:
            reason = str(e)
    where = where.format(reason)
    env = {**os.environ, **BIND_ENV}
    log = os.path.join(work, "mooncake-master.log")
    rpc, http, metrics = _free_ports(3)
    master = MooncakeMaster(ns, log, rpc_port=rpc, http_port=http, metrics_port=metrics)
    holder = child = None
    holder_log = open(os.path.join(work, "mooncake-holder.log"), "ab")  # noqa: SIM115 - closed below
    cfg = {"master_server_address": master.address, "metadata_server": master.metadata_url,
           "local_hostname": "127.0.0.1", "global_segment_mb": 0, "local_buffer_mb": 64, "timeout_s": 30.0,
           "setup_timeout_s": 60.0}
    stored_bytes = (max(args.prompts, RESTART_REQUESTS) + 2) * (args.context + 64) * bytes_per_token
    segment_mb = int(2 * stored_bytes) // 2**20 + 256
    me = os.path.abspath(__file__)
    try:
        master.start()
        holder = ns.popen([sys.executable, me, "holder", json.dumps({**cfg, "global_segment_mb": segment_mb})],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=holder_log, text=True, env=env)
        line = holder.stdout.readline()
        if not line.startswith("{") or json.loads(line).get("rc") != 0:
            return f"n/a: the segment holder did not set up ({line.strip() or holder.poll()}); see {log}"
        job = {"model_dir": model_dir, "mooncake": cfg, "args": {k: getattr(args, k) for k in (
            "device", "dtype", "eager", "read_threads", "l2_gb", "l3_gb", "context", "prompts", "vocab")}}
        with tempfile.TemporaryFile("w+") as out:
            child = ns.popen([sys.executable, me, "child", json.dumps(job)], stdout=out, stderr=subprocess.STDOUT,
                             text=True, env=env, cwd=os.path.dirname(os.path.dirname(me)))
            try:
                rc = child.wait(CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                rc = "timed out"
            out.seek(0)
            text = out.read()
        lines = [ln for ln in text.splitlines() if ln.startswith('{"mooncake_child"')]
        if rc != 0 or not lines:
            tail = " | ".join(text.strip().splitlines()[-3:])
            print(f"mooncake child (exit {rc}):\n{text[-6000:]}", flush=True)
            return f"n/a: the engine child failed (exit {rc}): {tail[-400:]}"
        res = json.loads(lines[-1])["mooncake_child"]
        res.update(segment_mb=segment_mb, transport=f"tcp on 127.0.0.1, {where}")
        return res
    finally:
        if holder is not None:
            holder.stdin.close()  # the holder unmounts and exits
            try:
                holder.wait(20)
            except subprocess.TimeoutExpired:
                pass
        for proc in (child, holder):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)
        master.stop()
        ns.delete()
        holder_log.close()


def _holder(cfg: dict) -> None:
    """Mount ``global_segment_mb`` into the store and keep it until stdin closes."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(cfg["local_hostname"], cfg["metadata_server"], cfg["global_segment_mb"] << 20,
                     cfg["local_buffer_mb"] << 20, "tcp", "", cfg["master_server_address"])
    print(json.dumps({"rc": rc}), flush=True)
    sys.stdin.read()
    store.close()


def _child(job: dict) -> dict:
    """The engines on Mooncake: store the prompts (their cold prefill is this run's recompute),
    then :func:`l3_warm` and :func:`first_after_restart`."""
    args = SimpleNamespace(**job["args"], engine_init_s=[], l2_pin_wait_s=[])
    model_dir, mc = job["model_dir"], job["mooncake"]
    prompts, stored, warm = stored_prompts(args)
    res: dict = {"mooncake_config": mc}
    eng = make_engine(args, model_dir, mc, max_total_tokens=l1_tokens(args), hicache_size=args.l2_gb,
                      hicache_storage_load_policy="always_load")
    if not eng.core.storage.tier.backend.connected:
        raise RuntimeError("the engine's Mooncake client did not connect")
    for p in warm[:2]:
        eng.generate(input_ids=p, sampling_params=ONE)
    rec, ref = [], []
    for p in stored:
        dt, out = timed(eng, p)
        rec.append(dt)
        ref.append(out["output_ids"])
    res["ttft_recompute_s"] = statistics.median(rec[: len(prompts)])
    persist(eng, res)
    close(eng, persist=True)
    l3_warm(res, args, model_dir, mc, prompts, warm, ref)
    res["l3_warm_x_recompute"] = res["ttft_l3_warm_s"] / res["ttft_recompute_s"]
    first_after_restart(res, args, model_dir, mc, stored)
    fractions(res, res["ttft_recompute_s"])
    res.update(engine_init_s=args.engine_init_s, l2_pin_wait_s=args.l2_pin_wait_s)
    return res


if __name__ == "__main__":
    if sys.argv[1] == "holder":
        _holder(json.loads(sys.argv[2]))
    elif sys.argv[1] == "child":
        print(json.dumps({"mooncake_child": _child(json.loads(sys.argv[2]))}), flush=True)
