"""`hicache serve --tp-size 2` over real HTTP (CPU, gloo): the same greedy tokens as one rank,
the shape check at startup, and a rank that dies taking the server down with a message."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from harness.engine_cases import GREEDY, ids_of, prompts
from harness.model_utils import smollm2_path, tiny_model
from harness.server_utils import ServerProcess, running_server
from serving.engine import Engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tp-server"), num_key_value_heads=2)


def _args(path) -> list[str]:
    return ["--model-path", str(path), "--page-size", "4", "--max-total-tokens", "2048", "--hicache-ratio", "2",
            "--tensor-parallel-size", "2"]


def _followers(server: ServerProcess) -> list[psutil.Process]:
    """The engine's tensor-parallel ranks: spawned children of the engine process."""
    engine = [c for c in psutil.Process(server.proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
    assert len(engine) == 1
    return [c for c in engine[0].children() if "spawn_main" in " ".join(c.cmdline())]


def test_tp2_server_matches_one_rank(tiny):
    ps = prompts(3, 512, seed=7, lo=20, hi=40)
    eng = Engine(model_path=str(tiny), page_size=4, max_total_tokens=2048)
    want = ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY))
    eng.shutdown()
    with running_server(_args(tiny)) as server:
        assert len(_followers(server)) == 1
        for _ in range(2):  # the second round hits the cache
            got = []
            for ids in ps:
                r = httpx.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}, timeout=60)
                assert r.status_code == 200, r.text
                got.append(r.json()["output_ids"])
            assert got == want
        assert r.json()["meta_info"]["cached_tokens"] > 0
        server.check_integrity()


def test_tp_size_must_divide_the_heads():
    server = ServerProcess(["--model-path", str(smollm2_path()), "--tp-size", "2"])
    with pytest.raises(RuntimeError) as e:
        server.start(timeout=120)
    assert "--tp-size 2 does not divide the model's 9 attention heads" in str(e.value)


def test_a_dead_rank_stops_the_server(tiny):
    server = ServerProcess(_args(tiny))
    server.start()
    try:
        (follower,) = _followers(server)
        follower.kill()
        server.proc.wait(60)  # no hang in a collective: the monitor stops the engine, the server exits
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    time.sleep(0.2)
    assert "tensor-parallel rank 1" in server.log() and "exited with code -9" in server.log(), server.log()[-3000:]
    assert server.proc.returncode != 0
