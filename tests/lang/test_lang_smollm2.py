"""The tutorial programs on SmolLM2 (fp32), on the local server and in process: the answers
themselves (Paris, Berlin, a valid IP, a character's JSON, ...), the cached tokens of forks and
batches, and the two backends agreeing (same greedy answers, same ``select`` scores)."""

from __future__ import annotations

import pytest

import serving.lang as sgl
from harness import lang_checks as checks
from harness import lang_programs as p
from harness.model_utils import smollm2_path
from harness.server_utils import running_server

pytestmark = pytest.mark.slow
ARGS = ["--dtype", "float32", "--page-size", "4", "--max-total-tokens", "8192", "--hicache-ratio", "0"]


@pytest.fixture(scope="module")
def native():
    with running_server(["--model-path", str(smollm2_path()), *ARGS]) as s:
        be = sgl.RuntimeEndpoint(s.url)
        yield be
        be.shutdown()
        s.check_integrity()


@pytest.fixture(scope="module")
def local():
    be = sgl.EngineBackend(model_path=str(smollm2_path()), dtype="float32", page_size=4, max_total_tokens=8192)
    yield be
    be.check_integrity()
    be.shutdown()


@pytest.fixture(params=["server", "in_process"])
def backend(request, native, local):
    return native if request.param == "server" else local


def test_tutorial_programs(backend, capsys) -> None:
    checks.check_basic_qa(backend, smart=True)
    checks.check_multi_turn(backend, smart=True)
    checks.check_select(backend, smart=True)
    checks.check_fork(backend, smart=True)
    checks.check_regex_and_json(backend, smart=True)
    checks.check_run_batch(backend, capsys, smart=True)
    checks.check_stream(backend, smart=True)


def test_backends_agree(native, local) -> None:
    for q in ("What is the capital of France?", "Name three colours."):
        a = p.basic_qa.run(question=q, backend=native, temperature=0)["answer"]
        b = p.basic_qa.run(question=q, backend=local, temperature=0)["answer"]
        assert a == b
    sa = p.capital.run(country="Spain", backend=native).get_meta_info("city")["scores"]
    sb = p.capital.run(country="Spain", backend=local).get_meta_info("city")["scores"]
    assert all(abs(x - y) < 1e-3 for x, y in zip(sa, sb, strict=True)), (sa, sb)
