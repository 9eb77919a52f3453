"""PD benchmark: prefill-decode disaggregation against two colocated servers, same hardware.

Setup A "colocated": 2 plain ``hicache serve`` servers behind the router (cache-aware policy).
Setup B "pd": 1 prefill + 1 decode server (radix cache on) behind the router in PD mode.
Both get the same mixed load (bench/pd_load.py): long answers decoding while long prompts
arrive. Reported per setup: TTFT p50/p99 (long prompts; all requests), ITL p50/p99 (the long
answers), output and prompt throughput, each server's /debug/check_integrity afterwards; for PD
the KV transfer rate from the prefill server's stats and, in the same run (servers stopped),
the raw transport rate for the same bytes per write (make_transport + raw_write_gbps, two
transports in this process) at the per-page chunk (one page of one layer's K or V) and at the
transfer's average coalesced chunk (estimated as one run per K/V plane and layer, an upper
bound). The transfer goal compares against the per-page raw rate.

CPU (defaults; 2 cores: OMP_NUM_THREADS=1 per server):
    python bench/pd.py --json bench/results/pd-cpu-2026-11-30.json
GPU (2 GPUs), e.g.:
    python bench/pd.py --model-path M --load-format dummy --dtype bfloat16 --backend nixl \\
        --device-prefill cuda:0 --device-decode cuda:1 --max-total-tokens 200000 --omp-threads 8 \\
        --long-prompt-len 2048 --long-interval 0.5 --decode-tokens 256 --duration 60
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import parser, print_table, write_json  # noqa: E402
from bench.pd_load import Load, Router, cpu_s, cpu_snapshot, others_cpu, run_load, stop, summarize  # noqa: E402
from harness.server_utils import ServerProcess, free_port  # noqa: E402

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def server_env(args: Any) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": str(args.omp_threads)}
    on_gpu = any((d or "").startswith("cuda") for d in (args.device_prefill, args.device_decode))
    if args.backend == "nixl" and not on_gpu:  # UCX over loopback on a CPU-only host
        env.update(UCX_TLS=os.environ.get("UCX_TLS", "tcp,self,sm"),
                   UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    return env


def base_args(args: Any, device: str | None) -> list[str]:
    a = ["--model-path", args.model_path, "--dtype", args.dtype, "--load-format", args.load_format]
    if args.max_total_tokens:
        a += ["--max-total-tokens", str(args.max_total_tokens)]
    if device:
        a += ["--device", device]
    for extra in args.server_arg or ():
        a += shlex.split(extra)
    return a


def start_all(servers: list[ServerProcess], env: dict[str, str]) -> None:
    for s in servers:
        s.env.update(env)
    with ThreadPoolExecutor(len(servers)) as ex:
        for f in [ex.submit(s.start, 300.0) for s in servers]:
            f.result()


def pd_stats(s: ServerProcess) -> dict[str, Any]:
    return httpx.get(s.url + "/get_server_info", timeout=60).json()["internal_states"][0].get("pd", {})


def warm_up(urls: list[str], router_url: str, load: Load) -> None:
    """Each server once directly (a long prompt), then a long and a short request through the router."""
    ids = [100 + i % 1000 for i in range(load.long_prompt_len)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    for u in [*urls, router_url]:
        r = httpx.post(u + "/generate", json=body, timeout=600)
        r.raise_for_status()
        body = {**body, "input_ids": [x + 1 for x in body["input_ids"]]}
    short = {"input_ids": list(range(200, 232)), "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    httpx.post(router_url + "/generate", json=short, timeout=600).raise_for_status()


def run_setup(name: str, args: Any, load: Load) -> dict[str, Any]:
    env = server_env(args)
    if name == "colocated":
        servers = [ServerProcess(base_args(args, d)) for d in (args.device_prefill, args.device_decode)]
        router = Router(["--worker-urls", *(s.url for s in servers)])
    else:
        bp = free_port()
        pd = ["--disaggregation-transfer-backend", args.backend]
        if args.transfer_host:
            pd += ["--disaggregation-transfer-host", args.transfer_host]
        servers = [
            ServerProcess([*base_args(args, args.device_prefill), *pd, "--disaggregation-mode", "prefill",
                           "--disaggregation-bootstrap-port", str(bp)]),
            ServerProcess([*base_args(args, args.device_decode), *pd, "--disaggregation-mode", "decode",
                           "--disaggregation-decode-enable-radix-cache"]),
        ]
        router = Router(["--pd-disaggregation", "--prefill", servers[0].url, str(bp), "--decode", servers[1].url])
    out: dict[str, Any] = {"setup": name}
    t_start = time.perf_counter()
    try:
        start_all(servers, env)
        router.start()
        info = httpx.get(servers[0].url + "/get_server_info", timeout=60).json()
        out["engine"] = {k: info["engine"].get(k) for k in ("device", "dtype", "page_size", "num_pages", "vocab_size")}
        out["engine"]["devices"] = [httpx.get(s.url + "/get_server_info", timeout=60).json()["engine"]["device"]
                                    for s in servers]
        warm_up([s.url for s in servers], router.url, load)
        before = pd_stats(servers[0]) if name == "pd" else {}
        c0, t = [cpu_s(s) for s in servers], time.perf_counter()
        time.sleep(3.0)  # idle: what the servers burn with nothing to do (a transport's polling thread...)
        dt = time.perf_counter() - t
        out["idle_cpu_cores"] = [(cpu_s(s) - c) / dt for s, c in zip(servers, c0, strict=True)]
        print(f"[{name}] servers up in {time.perf_counter() - t_start:.0f} s; load for {load.duration_s:.0f} s",
              flush=True)
        out["loadavg_before"] = os.getloadavg()
        c0, snap, tc = [cpu_s(s) for s in servers], cpu_snapshot(), time.perf_counter()
        vocab = int(out["engine"]["vocab_size"] or load.vocab)
        recs, t0, deadline = asyncio.run(run_load(router.url, Load(**{**load.__dict__, "vocab": min(vocab, 40000)})))
        out["loadavg_after"] = os.getloadavg()
        dt = time.perf_counter() - tc
        out["load_cpu_cores"] = [(cpu_s(s) - c) / dt for s, c in zip(servers, c0, strict=True)]
        out["others_cpu"] = others_cpu(snap, dt, [s.proc.pid for s in servers] + [router.proc.pid])
        out.update(summarize(recs, t0, deadline))
        out["integrity"] = [s.check_integrity(settle_s=60.0) for s in servers]
        if name == "pd":
            after = pd_stats(servers[0])
            out["prefill_pd"] = after
            out["decode_pd"] = pd_stats(servers[1])
            out["transfer"] = transfer(before, after)
    except Exception as e:  # noqa: BLE001 - reported, with the logs
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
        out["logs"] = {f"server{i}": s.log()[-3000:] for i, s in enumerate(servers)}
        out["logs"]["router"] = "".join(router.lines)[-3000:]
        print(f"[{name}] FAILED: {out['error']}", flush=True)
    finally:
        out["router_exit"] = router.stop()
        out["exit_codes"] = [stop(s) for s in servers]
        out["tracebacks_in_logs"] = sum("Traceback" in s.log() for s in servers)
    out["wall_s"] = time.perf_counter() - t_start
    return out


def transfer(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("sent", "send_failed", "expired", "pages_sent", "bytes_sent",
                                                           "transfer_s")}
    d["gbps"] = d["bytes_sent"] / d["transfer_s"] / 1e9 if d["transfer_s"] > 0 else None
    d["bytes_per_transfer"] = d["bytes_sent"] / d["sent"] if d["sent"] else None
    d["ms_per_transfer"] = d["transfer_s"] / d["sent"] * 1e3 if d["sent"] else None
    return d


def kv_chunk(args: Any, engine: dict[str, Any]) -> tuple[int, int]:
    """(bytes of one page of one layer's K, number of layers) from the model's config and the engine's info."""
    cfg = json.loads((ROOT / args.model_path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    chunk = int(engine["page_size"]) * kv_heads * head_dim * DTYPE_BYTES[str(engine["dtype"])]
    return chunk, int(cfg["num_hidden_layers"])


def raw_rates(args: Any, chunk: int, layers: int, per_transfer: float | None, load: Load, page: int) -> dict[str, Any]:
    """Raw transport GB/s for writes of the average transfer's size at the per-page and coalesced chunks."""
    import torch

    from serving.disagg.transport import make_transport, raw_write_gbps
    from serving.disagg.transport_base import TransportConfig

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # mooncake: no per-connection INFO lines
    if args.backend == "nixl":
        for k, v in server_env(args).items():
            if k.startswith("UCX_"):
                os.environ.setdefault(k, v)
    planes = 2 * layers
    if not per_transfer:  # no transfer happened: what one long prompt would send
        per_transfer = -(-load.long_prompt_len // page) * chunk * planes
    coalesced = max(chunk, int(per_transfer / planes) // chunk * chunk)
    nbytes = coalesced * planes  # a multiple of both chunk sizes
    out: dict[str, Any] = {"nbytes": nbytes, "chunk_page": chunk, "chunk_coalesced_est": coalesced,
                           "devices": [args.device_prefill or "cpu", args.device_decode or "cpu"]}
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=d) for d in out["devices"]]
    a = b = None
    try:
        cfg = TransportConfig(host=args.transfer_host)
        a, b = make_transport(args.backend, cfg), make_transport(args.backend, cfg)
        a.register_tensor(bufs[0])
        b.register_tensor(bufs[1])
        out["gbps_page"] = raw_write_gbps(a, b, nbytes, chunk, repeat=args.raw_repeat)
        out["gbps_coalesced"] = raw_write_gbps(a, b, nbytes, coalesced, repeat=args.raw_repeat)
    except Exception as e:  # noqa: BLE001 - e.g. a transport that cannot loop back within one process
        out["error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        for t in (a, b):
            if t is not None:
                t.close()
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--model-path", default="models/SmolLM2-135M-Instruct")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device-prefill", default=None, help="--device of the prefill server (colocated: server 0)")
    p.add_argument("--device-decode", default=None, help="--device of the decode server (colocated: server 1)")
    p.add_argument("--backend", default="nixl", help="KV transport: nixl | mooncake | cuda_ipc ...")
    p.add_argument("--transfer-host", default=None)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--server-arg", action="append", help="extra `hicache serve` argument(s), repeatable")
    p.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS of each server")
    p.add_argument("--setups", default="colocated,pd")
    p.add_argument("--raw-repeat", type=int, default=5)
    p.add_argument("--note", default="", help="appended to the JSON's note")
    d = Load()
    for f in ("duration_s", "decoders", "decode_prompt_len", "decode_tokens", "long_prompt_len", "long_interval_s",
              "long_tokens", "grace_s", "seed"):
        flag = "--" + f.removesuffix("_s").replace("_", "-")
        p.add_argument(flag, dest=f, type=type(getattr(d, f)), default=getattr(d, f))
    args = p.parse_args()
    load = Load(**{f: getattr(args, f) for f in d.__dict__ if hasattr(args, f)})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop the servers

    cores = os.cpu_count()
    print(f"{cores} CPU cores; OMP_NUM_THREADS={args.omp_threads} per server; the servers, router and this "
          f"client share them", flush=True)
    res: dict[str, Any] = {"config": vars(args), "load": load.__dict__, "cpu_cores": cores, "setups": {}}
    for name in args.setups.split(","):
        res["setups"][name] = run_setup(name, args, load)
    col, pd = res["setups"].get("colocated", {}), res["setups"].get("pd", {})
    if "engine" in pd:
        try:
            chunk, layers = kv_chunk(args, pd["engine"])
            per = (pd.get("transfer") or {}).get("bytes_per_transfer")
            res["raw"] = raw_rates(args, chunk, layers, per, load, int(pd["engine"]["page_size"]))
        except Exception as e:  # noqa: BLE001 - e.g. no config.json next to the model
            res["raw"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    raw = res.get("raw", {})
    tr = pd.get("transfer", {})

    metrics = ["ttft_long_p50_ms", "ttft_long_p99_ms", "ttft_all_p50_ms", "ttft_all_p99_ms", "itl_p50_ms",
               "itl_p99_ms", "max_gap_ms", "output_tok_s", "prompt_tok_s", "long_requests", "long_done",
               "decode_requests", "itl_samples", "errors"]
    rows = [[m, col.get(m), pd.get(m)] for m in metrics]
    rows.append(["integrity ok", [i.get("ok") for i in col.get("integrity", [])],
                 [i.get("ok") for i in pd.get("integrity", [])]])
    for k in ("idle_cpu_cores", "load_cpu_cores", "loadavg_before"):
        rows.append([k, [round(x, 2) for x in col.get(k, [])], [round(x, 2) for x in pd.get(k, [])]])
    rows.append(["other processes' cores", (col.get("others_cpu") or {}).get("cores"),
                 (pd.get("others_cpu") or {}).get("cores")])
    rows.append(["exit codes", col.get("exit_codes"), pd.get("exit_codes")])
    print()
    print_table(["metric", "colocated", "pd"], rows)
    print()
    print_table(["KV transfer (pd)", "value"], [
        ["transfers", tr.get("sent")], ["failed / expired", f"{tr.get('send_failed')} / {tr.get('expired')}"],
        ["MB per transfer", tr["bytes_per_transfer"] / 1e6 if tr.get("bytes_per_transfer") else None],
        ["ms per transfer", tr.get("ms_per_transfer")],
        ["transfer GB/s", tr.get("gbps")],
        [f"raw GB/s, {raw.get('chunk_page')} B chunks", raw.get("gbps_page")],
        [f"raw GB/s, {raw.get('chunk_coalesced_est')} B chunks (coalesced, est.)", raw.get("gbps_coalesced")],
        ["raw error", raw.get("error", "-")]])
    goals = [
        {"goal": "ITL p99: colocated / pd >= 3", "value": ratio(col.get("itl_p99_ms"), pd.get("itl_p99_ms")),
         "target": 3.0, "op": ">="},
        {"goal": "TTFT long p50: pd / colocated <= 1.2",
         "value": ratio(pd.get("ttft_long_p50_ms"), col.get("ttft_long_p50_ms")), "target": 1.2, "op": "<="},
        {"goal": "transfer GB/s / raw (per-page chunk) >= 0.8", "value": ratio(tr.get("gbps"), raw.get("gbps_page")),
         "target": 0.8, "op": ">="},
    ]
    for g in goals:
        v = g["value"]
        g["met"] = None if v is None else (v >= g["target"] if g["op"] == ">=" else v <= g["target"])
    res["goals"] = goals
    res["transfer_goal_compares_against"] = f"raw GB/s at the per-page chunk ({raw.get('chunk_page')} B)"
    res["transfer_vs_raw_coalesced"] = ratio(tr.get("gbps"), raw.get("gbps_coalesced"))
    print()
    print_table(["goal", "value", "met"], [[g["goal"], g["value"], g["met"]] for g in goals]
                + [["(info) transfer / raw at coalesced chunk", res["transfer_vs_raw_coalesced"], "-"]])
    res["note"] = (f"{cores} CPU cores: both setups' servers (OMP_NUM_THREADS={args.omp_threads} each), the router "
                   "and the load client share the same cores, so in PD the decode server still competes with "
                   "the prefill server for CPU (the isolation PD buys on separate GPUs is only partial here). "
                   + args.note).strip()
    write_json(args.json, res)


if __name__ == "__main__":
    main()
