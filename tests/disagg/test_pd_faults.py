"""PD faults, each with a clear error and nothing leaked (real servers, NIXL over UCX on loopback):
a reused bootstrap room, a transfer that never comes (timeout), a client that disconnects while
its KV is awaited, the decode server dying before its KV is written, the prefill server dying
while a decode request waits (the decode side aborts; the router retries on another prefill
server), and a transport that cannot start."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.pd_pair import nixl_or_skip
from harness.server_utils import ServerProcess, free_port, kill_tree, start_all

pytestmark = pytest.mark.slow
TIMEOUT_S = 6.0  # --disaggregation-bootstrap-timeout-s of these servers (a busy 2-core machine must meet it)


@pytest.fixture(autouse=True)
def _ucx_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", os.environ.get("UCX_TLS", "tcp,self,sm"))
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def _args(model: Path, mode: str, bootstrap_port: int | None = None) -> list[str]:
    args = ["--model-path", str(model), "--served-model-name", "tiny", "--max-total-tokens", "4096",
            "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "nixl",
            "--disaggregation-bootstrap-timeout-s", str(TIMEOUT_S)]
    if bootstrap_port is not None:
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return args


def _pd(s: ServerProcess) -> dict:
    return httpx.get(s.url + "/get_server_info", timeout=30).json()["internal_states"][0]["pd"]


def _used(s: ServerProcess) -> int:
    return httpx.get(s.url + "/get_server_info", timeout=30).json()["internal_states"][0]["pages"]["device"]["used"]


def _wait(cond, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def _post_in_background(url: str, body: dict) -> tuple[threading.Thread, list[httpx.Response]]:
    """POST ``body`` to ``url``/generate on a thread (a decode request waits for its KV): the
    started thread and the list its response lands in."""
    out: list[httpx.Response] = []
    t = threading.Thread(target=lambda: out.append(httpx.post(url + "/generate", json=body, timeout=60)))
    t.start()
    return t, out


def _body(bp: int, room: int, text: str = "hello there, how are you today?", **kw: object) -> dict:
    return {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 4}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bp, "bootstrap_room": room, **kw}


@pytest.fixture(scope="module")
def pair(tiny_chat_model: Path) -> Iterator[tuple[ServerProcess, ServerProcess, int]]:
    nixl_or_skip()
    bp = free_port()
    p, d = ServerProcess(_args(tiny_chat_model, "prefill", bp)), ServerProcess(_args(tiny_chat_model, "decode"))
    old = {k: os.environ.get(k) for k in ("UCX_TLS", "UCX_NET_DEVICES", "OMP_NUM_THREADS")}
    os.environ.update(UCX_TLS=old["UCX_TLS"] or "tcp,self,sm", UCX_NET_DEVICES="lo", OMP_NUM_THREADS="1")
    try:
        start_all(p, d)
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        yield p, d, bp
    finally:
        codes = [s.stop() for s in (p, d)]
        assert codes == [0, 0], (codes, p.log()[-2000:], d.log()[-2000:])


def test_reused_room_and_timeout_leak_nothing(pair: tuple[ServerProcess, ServerProcess, int]) -> None:
    p, d, bp = pair
    base = _used(d)
    room = random.getrandbits(63)
    t, results = _post_in_background(d.url, _body(bp, room))  # the prefill server never gets it: no KV comes
    assert _wait(lambda: _pd(d)["registered"] == 1)
    again = httpx.post(d.url + "/generate", json=_body(bp, room), timeout=30)
    assert again.status_code == 400 and "already in use" in again.text, again.text
    t.join(30)
    [first] = results
    assert first.status_code == 504, first.text
    assert "did not arrive" in first.text or "never received" in first.text, first.text
    # the failed request's pages are quarantined (a late write cannot land in reused pages), then freed
    assert _wait(lambda: _pd(d)["quarantined"] == 0, 4 * TIMEOUT_S)
    assert _used(d) == base
    d.check_integrity()
    p.check_integrity()
    assert _wait(lambda: _pd(p)["targets_waiting"] == 0, 3 * TIMEOUT_S)  # the prefill side forgot the room too


def test_client_disconnect_while_kv_in_flight(pair: tuple[ServerProcess, ServerProcess, int]) -> None:
    p, d, bp = pair
    base = _used(d)
    room = random.getrandbits(63)
    with httpx.stream("POST", d.url + "/generate", json=_body(bp, room, stream=True), timeout=30) as r:
        assert r.status_code == 200
        assert _wait(lambda: _pd(d)["registered"] == 1)
    # the client went away before the KV arrived: the decode side aborts and quarantines the pages
    assert _wait(lambda: _pd(d)["registered"] == 0, 10)
    assert _wait(lambda: _pd(d)["quarantined"] == 0 and _used(d) == base, 4 * TIMEOUT_S)
    d.check_integrity()
    # the pair still serves
    room = random.getrandbits(63)
    t, out = _post_in_background(d.url, _body(bp, room))
    rp = httpx.post(p.url + "/generate", json=_body(bp, room), timeout=60)
    t.join(60)
    assert rp.status_code == 200 and out[0].status_code == 200, (rp.text, out[0].text)
    assert len(out[0].json()["output_ids"]) == 4


def test_decode_dies_before_its_kv_is_written(tiny_chat_model: Path) -> None:
    nixl_or_skip()
    bp = free_port()
    p, d = ServerProcess(_args(tiny_chat_model, "prefill", bp)), ServerProcess(_args(tiny_chat_model, "decode"))
    start_all(p, d)
    try:
        base = _used(p)
        room = random.getrandbits(63)
        def doomed() -> None:  # its server is killed under it
            try:
                httpx.post(d.url + "/generate", json=_body(bp, room), timeout=60)
            except httpx.HTTPError:
                pass

        threading.Thread(target=doomed, daemon=True).start()
        assert _wait(lambda: _pd(p)["targets_waiting"] == 1)  # the decode side registered its pages
        kill_tree(d.proc)  # a crash, not a shutdown
        r = httpx.post(p.url + "/generate", json=_body(bp, room), timeout=60)
        assert r.status_code == 200, r.text  # the prefill itself completed
        assert _wait(lambda: _pd(p)["send_failed"] == 1)  # the write to a dead peer failed ...
        st = _pd(p)
        assert st["parked"] == st["sending"] == 0, st  # ... and the prefill side let go of the pages
        p.check_integrity()
        httpx.post(p.url + "/flush_cache", timeout=30)
        assert _used(p) == base
        assert "Traceback" not in p.log(), p.log()[-3000:]
    finally:
        assert p.stop() == 0, p.log()[-3000:]


def test_prefill_dies_decode_aborts_router_retries(tiny_chat_model: Path) -> None:
    nixl_or_skip()
    bp1, bp2 = free_port(), free_port()
    p1 = ServerProcess(_args(tiny_chat_model, "prefill", bp1))
    p2 = ServerProcess(_args(tiny_chat_model, "prefill", bp2))
    d = ServerProcess(_args(tiny_chat_model, "decode"))
    start_all(p1, p2, d)
    try:
        base = _used(d)
        room = random.getrandbits(63)
        t, res = _post_in_background(d.url, _body(bp1, room))
        assert _wait(lambda: _pd(p1)["targets_waiting"] == 1)
        kill_tree(p1.proc)  # a crash
        t.join(30)
        assert res and res[0].status_code == 502, res  # well before the bootstrap timeout
        assert "went away" in res[0].text or "unreachable" in res[0].text, res[0].text
        assert _wait(lambda: _pd(d)["quarantined"] == 0 and _used(d) == base, 4 * TIMEOUT_S)
        d.check_integrity()
        # through the router: the dead prefill server fails, the retry goes to the live one
        from router.config import RouterConfig  # noqa: PLC0415
        from router.embedded import RouterThread  # noqa: PLC0415

        cfg = RouterConfig(pd_disaggregation=True, prefill_urls=((p1.url, bp1), (p2.url, bp2)),
                           decode_urls=(d.url,), health_check_interval_s=30.0)
        with RouterThread(cfg) as rt:
            for i in range(3):
                r = httpx.post(rt.url + "/generate", timeout=60,
                               json={"text": f"retry {i}", "sampling_params": {"temperature": 0, "max_new_tokens": 3}})
                assert r.status_code == 200, r.text
                assert len(r.json()["output_ids"]) == 3
        d.check_integrity()
        p2.check_integrity()
    finally:
        for s in (p2, d):
            assert s.stop() == 0, s.log()[-3000:]


def test_transport_that_cannot_start_names_the_missing_piece(tiny_chat_model: Path, tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"  # NIXL's native library missing, as on a machine without UCX
    for mod in ("nixl", "nixl_cu12", "nixl_cu13"):
        (shadow / mod).mkdir(parents=True)
        (shadow / mod / "__init__.py").write_text("raise ImportError('libucs.so.0: cannot open shared object file')\n")
    s = ServerProcess(_args(tiny_chat_model, "decode"))
    s.env["PYTHONPATH"] = f"{shadow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    with pytest.raises(RuntimeError) as err:
        s.start(timeout=120)
    log = s.log()
    assert "nixl" in log and "libucs.so.0" in log, log[-3000:]
    assert "engine failed to start" in log, log[-3000:]
    assert s.proc.poll() is not None, err.value  # the server exited (start raised): nothing left running


def test_peers_with_other_weights_refuse_each_others_kv(tiny_chat_model: Path) -> None:
    """A prefill server on int8 weights and a decode server on fp32 ones: same KV bytes, another
    model's KV. The transfer is refused with a message naming both modes, and nothing leaks."""
    nixl_or_skip()
    bp = free_port()
    p = ServerProcess([*_args(tiny_chat_model, "prefill", bp), "--quantization", "int8"])
    d = ServerProcess(_args(tiny_chat_model, "decode"))
    start_all(p, d)
    try:
        base = _used(d)
        room = random.getrandbits(63)
        t, out = _post_in_background(d.url, _body(bp, room))
        assert _wait(lambda: _pd(d)["registered"] == 1)
        rp = httpx.post(p.url + "/generate", json=_body(bp, room), timeout=60)
        t.join(60)
        [rd] = out
        assert rd.status_code >= 500 and "model_tag differs: q:int8v2|rt:raw" in rd.text, rd.text
        assert "q:none|rt:raw" in rd.text, rd.text
        del rp  # the prefill side's own answer is not what this test is about
        assert _wait(lambda: _pd(d)["quarantined"] == 0 and _used(d) == base, 4 * TIMEOUT_S)
        d.check_integrity()
        p.check_integrity()
    finally:
        codes = [s.stop() for s in (p, d)]
    assert codes == [0, 0], codes
