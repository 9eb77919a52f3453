"""Driver for tests/disagg/test_pd_e2e.py: a real 1 prefill + 1 decode cluster behind the real router,
beside a colocated server (the reference). For Mooncake it runs INSIDE a test network
namespace (the transfer engine needs a LAN address); NIXL runs over UCX on loopback.

    python harness/pd_cluster.py BACKEND WORK_DIR TRANSFER_HOST [--l3] [--quick]

Prints one JSON line of findings on stdout (the test asserts on them). ``--l3``: both PD
servers also get Mooncake Store as L3 (a real mooncake_master in the namespace), and the
L3 scenario runs (the decode side publishes each finished sequence; the prefill side,
its own cache flushed, finds the previous answer's KV there). ``--quick``: no session scenario.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.server_utils import RouterProcess, ServerProcess, free_port, start_all  # noqa: E402

MODEL = str(ROOT / "models" / "SmolLM2-135M-Instruct")
GREEDY = {"temperature": 0, "max_new_tokens": 12}
RPC, HTTP, METRICS = 50061, 50081, 50091


def start_master(work: Path) -> subprocess.Popen:
    exe = Path(sys.executable).parent / "mooncake_master"
    argv = [str(exe), "--rpc_address=127.0.0.1", f"--rpc_port={RPC}", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={HTTP}", f"--metrics_port={METRICS}"]
    proc = subprocess.Popen(argv, stdout=open(work / "master.log", "ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{HTTP}/metadata", timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("mooncake_master did not come up")


def l3_config(work: Path, address: str) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "mooncake.yaml").read_text())
    cfg["cache"]["hicache_storage_backend_extra_config"] = {
        "master_server_address": f"127.0.0.1:{RPC}", "metadata_server": f"http://127.0.0.1:{HTTP}/metadata",
        "local_hostname": address, "global_segment_mb": 128, "local_buffer_mb": 64}
    # always_load: the scenario checks that the decode side's pages come back from L3; with a tiny model the
    # cost model may judge a recompute faster than a Mooncake read on a loaded machine (CI: 0 pages from L3)
    cfg["cache"].update(hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=16,
                        hicache_storage_load_policy="always_load")
    out = work / "l3.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def integrity(*servers: ServerProcess) -> bool:
    """Every server's check_integrity passed (``ok``), once its requests have settled."""
    return all(s.check_integrity()["ok"] for s in servers)


def lookup(s: ServerProcess, ids: list[int]) -> dict[str, int]:
    """The leading tokens of ``ids`` that ``s`` finds on L1, then L2, then L3 (/cache/lookup)."""
    return httpx.post(s.url + "/cache/lookup", json={"input_ids": ids}, timeout=30).json()["cached_tokens"]


def pd_stats(s: ServerProcess) -> dict:
    return httpx.get(s.url + "/get_server_info", timeout=30).json()["internal_states"][0].get("pd", {})


def generate(url: str, body: dict) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, (r.status_code, r.text)
    return r.json()


def chat_stream(url: str, messages: list[dict]) -> str:
    body = {"model": "m", "messages": messages, "max_tokens": 12, "temperature": 0, "stream": True}
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    text += ch["delta"].get("content") or ""
    return text


def scenarios(out: dict, router: RouterProcess, P: ServerProcess, D: ServerProcess, C: ServerProcess,
              quick: bool) -> None:
    prompts = ["The capital of France is", "List three colours:", "def fibonacci(n):"]
    # single prompts, token-identical to the colocated server
    same = []
    for p in prompts:
        body = {"text": p, "sampling_params": GREEDY}
        same.append(generate(router.url, body)["output_ids"] == generate(C.url, body)["output_ids"])
    out["single_same"] = same
    out["integrity_single"] = integrity(P, D)
    # a batch
    body = {"text": prompts, "sampling_params": GREEDY}
    out["batch_same"] = [a["output_ids"] for a in generate(router.url, body)] == \
        [b["output_ids"] for b in generate(C.url, body)]
    # a stream
    msgs = [{"role": "user", "content": "Name a large animal."}]
    out["stream_same"] = chat_stream(router.url, msgs) == chat_stream(C.url, msgs)
    # concurrent requests
    with ThreadPoolExecutor(6) as ex:
        bodies = [{"text": f"Question {i}: what is {i} plus {i}?", "sampling_params": GREEDY} for i in range(6)]
        got = list(ex.map(lambda b: generate(router.url, b)["output_ids"], bodies))
    out["concurrent_same"] = got == [generate(C.url, b)["output_ids"] for b in bodies]
    out["integrity_batch"] = integrity(P, D)
    if quick:
        return
    # a session over three turns: later turns hit the prefill side's cache
    sid = httpx.post(router.url + "/open_session", json={}, timeout=30).json()
    sid = sid if isinstance(sid, str) else sid.get("session_id", sid)
    history = "You are a helpful assistant. " * 8 + "User: tell me a story about a cat.\nAssistant:"
    turns = []
    for t in range(3):
        body = {"text": history, "sampling_params": GREEDY, "session_id": sid}
        got = generate(router.url, body)
        ref = generate(C.url, {"text": history, "sampling_params": GREEDY})
        meta = got["meta_info"]
        turns.append({"same": got["output_ids"] == ref["output_ids"], "prompt_tokens": meta["prompt_tokens"],
                      "cached_tokens": meta["cached_tokens"]})
        history += got["text"] + f"\nUser: and then what happened {t}?\nAssistant:"
    httpx.post(router.url + "/close_session", json={"session_id": sid}, timeout=30)
    out["session_turns"] = turns
    out["integrity_session"] = integrity(P, D)


def l3_scenario(out: dict, router: RouterProcess, P: ServerProcess, D: ServerProcess, C: ServerProcess) -> None:
    """Turn 1 through PD; the prefill side forgets everything (flush); turn 2 = turn 1 +
    answer + more: its prefill must find the answer's KV in L3, written by the decode side."""
    rng = random.Random(5)
    first = [rng.randrange(100, 40000) for _ in range(200)]
    t1 = generate(router.url, {"input_ids": first, "sampling_params": {"temperature": 0, "max_new_tokens": 40,
                                                                        "ignore_eos": True}})
    answer = t1["output_ids"]
    deadline = time.monotonic() + 60  # until the decode side's write-back of the answer reached Mooncake Store
    while time.monotonic() < deadline and sum(lookup(P, first + answer).values()) <= len(first):
        time.sleep(0.3)
    assert httpx.post(P.url + "/flush_cache", timeout=30).status_code == 200
    second = first + answer + [rng.randrange(100, 40000) for _ in range(20)]
    body = {"input_ids": second, "sampling_params": GREEDY}
    t2 = generate(router.url, body)
    ref = generate(C.url, body)
    details = t2["meta_info"]["cached_tokens_details"]
    out["l3_same"] = t2["output_ids"] == ref["output_ids"]
    out["l3_storage_tokens"] = details.get("storage", 0)
    out["l3_prompt_first_tokens"] = len(first)
    out["l3_turn2_prompt_tokens"] = len(second)
    out["integrity_l3"] = integrity(P, D)
    for name, s in (("prefill", P), ("decode", D)):  # what each side's L3 did (read when an assertion fails)
        st = httpx.get(s.url + "/get_server_info", timeout=30).json()["internal_states"][0].get("storage", {})
        out[f"l3_{name}_storage"] = {k: v for k, v in st.items() if isinstance(v, int | float)}


def main() -> None:
    backend, work, host = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    with_l3 = "--l3" in sys.argv
    master = start_master(work) if with_l3 else None
    base = ["--model-path", MODEL, "--max-total-tokens", "8192", "--served-model-name", "m"]
    pd = ["--disaggregation-transfer-backend", backend, "--disaggregation-transfer-host", host,
          "--disaggregation-bootstrap-timeout-s", "30"]
    if with_l3:
        pd += ["--config", str(l3_config(work, host))]
    bp = free_port()
    P = ServerProcess([*base, *pd, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bp)])
    D = ServerProcess([*base, *pd, "--disaggregation-mode", "decode", "--disaggregation-decode-enable-radix-cache"])
    C = ServerProcess(base)
    servers = [P, D, C]
    router = RouterProcess(["--pd-disaggregation", "--prefill", P.url, str(bp), "--decode", D.url])
    out: dict = {"backend": backend}
    try:
        start_all(*servers)
        router.start()
        scenarios(out, router, P, D, C, "--quick" in sys.argv)
        if with_l3:
            l3_scenario(out, router, P, D, C)
        out["prefill_pd"], out["decode_pd"] = pd_stats(P), pd_stats(D)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, with the servers' logs
        out["error"] = f"{type(e).__name__}: {e}"
        out["logs"] = {"prefill": P.log()[-4000:], "decode": D.log()[-4000:], "router": "".join(router.lines)[-3000:]}
    finally:
        if router.ready.is_set():
            router.stop()
        with ThreadPoolExecutor(len(servers)) as ex:  # each persists its cache on the way out: side by side
            out["exit_codes"] = list(ex.map(lambda s: s.stop() if s.proc is not None else None, servers))
        if master is not None:
            master.kill()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
