"""Grammar work is bounded in memory as well as time (issue 25, finding 1): a ~150-byte
self-recursive JSON schema or EBNF grammar made the engine grow ~0.5 GB/s until the OOM
killer ended it (xgrammar's jump-forward string of a grammar that forces an infinite string).

Whatever reproduces the kill runs in a child process with an address-space limit
(RLIMIT_AS), so that on a broken engine the child fails and the suite survives: the offline
engine in a child (the jump-forward bounds), the server with its engine process limited
(the hostile grammars through /generate and OpenAI's response_format while other requests
run). A compile over its memory budget is a 400 naming the limit, its worker replaced."""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from harness.server_utils import ROOT, ServerProcess, running_server

pytestmark = pytest.mark.slow

RECURSIVE_SCHEMA = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
                    "$ref": "#/$defs/n"}
RECURSIVE_EBNF = 'root ::= "ab" root'
# finite, but forces 2^30 bytes "Q" (SmolLM2's vocabulary has no "QQ": each forced token is "Q")
DOUBLING_EBNF = 'root ::= r30\nr0 ::= "Q"\n' + "\n".join(f"r{i} ::= r{i - 1} r{i - 1}" for i in range(1, 31))
JSON_UNIT, EBNF_UNIT = '{"c": ', "ab"  # the infinite strings the recursive grammars force
HEADROOM = 3 * 2**30  # address space the limited processes may add (the bug: 0.5 GB/s, no end)
RSS_GROWTH_BOUND = 512 * 2**20  # the engine's RSS across the hostile requests


def _limit_address_space(proc: psutil.Process, extra: int = HEADROOM) -> None:
    proc.rlimit(psutil.RLIMIT_AS, (proc.memory_info().vms + extra, psutil.RLIM_INFINITY))


def _is_prefix_of_repeats(text: str, unit: str) -> bool:
    return (unit * (len(text) // len(unit) + 1)).startswith(text)


# -- the offline engine, in a child with a memory limit -----------------------------------------
def bounded_jump_child(model_path: str) -> None:
    """Run in a child process (``_run_child``): prints one line ``RESULT <json>``."""
    import resource

    from serving.engine import Engine

    eng = Engine(model_path=model_path, max_total_tokens=4096, max_running_requests=4, grammar_compile_workers=1)
    me = psutil.Process()
    resource.setrlimit(resource.RLIMIT_AS, (me.memory_info().vms + HEADROOM, resource.RLIM_INFINITY))
    g = eng.core.grammar
    out: dict = {}

    def run(name: str, params: dict, **limits: float) -> None:
        saved = getattr(g, "jump_max_tokens", 256), getattr(g, "jump_max_s", 0.02)
        g.jump_max_tokens = int(limits.get("tokens", saved[0]))
        g.jump_max_s = limits.get("seconds", saved[1])
        before = dict(vars(g.stats))
        o = eng.generate("Hi", {"temperature": 0, **params})
        g.jump_max_tokens, g.jump_max_s = saved
        out[name] = {"text": o["text"], "finish": o["meta_info"]["finish_reason"],
                     **{k: v - before[k] for k, v in vars(g.stats).items() if isinstance(v, int)}}

    run("recursive_ebnf", {"max_new_tokens": 24, "ebnf": RECURSIVE_EBNF})
    run("recursive_schema", {"max_new_tokens": 24, "json_schema": json.dumps(RECURSIVE_SCHEMA)})
    run("doubling_left", {"max_new_tokens": 40, "ebnf": DOUBLING_EBNF})  # bound: the tokens left
    run("doubling_capped", {"max_new_tokens": 100, "ebnf": DOUBLING_EBNF}, tokens=16)  # 16 per look-ahead
    run("doubling_timed", {"max_new_tokens": 20, "ebnf": DOUBLING_EBNF}, seconds=1e-9)  # bound: time
    eng.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


@pytest.fixture(scope="module")
def bounded(tiny_chat_model: Path) -> dict:
    code = (f"from tests.engine.test_grammar_limits import bounded_jump_child; "
            f"bounded_jump_child({str(tiny_chat_model)!r})")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"the engine failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_recursive_grammars_run_step_by_step(bounded: dict) -> None:
    for name, unit in (("recursive_ebnf", EBNF_UNIT), ("recursive_schema", JSON_UNIT)):
        o = bounded[name]
        assert o["finish"] == {"type": "length", "length": 24}, o
        assert _is_prefix_of_repeats(o["text"], unit) and len(o["text"]) >= 24 // 2, o


def test_jump_forward_stops_at_the_tokens_left(bounded: dict) -> None:
    o = bounded["doubling_left"]
    assert o["text"] == "Q" * 40 and o["finish"] == {"type": "length", "length": 40}, o
    # the first token is sampled, the other 39 jumped at once: the look-ahead saw no further
    assert o["jumped_tokens"] == o["looked_ahead"] == 39 and o["jumps"] == 1 and o["jump_capped"] == 0, o


def test_jump_forward_stops_at_its_token_cap(bounded: dict) -> None:
    o = bounded["doubling_capped"]  # grammar_jump_forward_max_tokens=16
    assert o["text"] == "Q" * 100 and o["finish"] == {"type": "length", "length": 100}, o
    assert o["jumps"] >= 5 and o["jumped_tokens"] <= 16 * o["jumps"] and o["jumped_tokens"] >= 80, o
    assert o["jump_capped"] >= 5, o


def test_jump_forward_stops_at_its_time_cap(bounded: dict) -> None:
    o = bounded["doubling_timed"]  # every look-ahead stops after its first token: runs too short to jump
    assert o["text"] == "Q" * 20 and o["finish"] == {"type": "length", "length": 20}, o
    assert o["jump_capped"] >= 10 and o["jumped_tokens"] <= 1, o


def test_jump_forward_limits_are_config_fields(tiny_chat_model: Path) -> None:
    from serving.config import SchedulerConfig
    from serving.grammar.runner import make_grammar_runner
    from serving.tokenizer import Tokenizer

    for bad in ({"grammar_jump_forward_max_tokens": 0}, {"grammar_jump_forward_max_ms": 0.0},
                {"grammar_compile_max_memory_mb": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SchedulerConfig(**bad)
    cfg = SchedulerConfig(grammar_jump_forward_max_tokens=16, grammar_jump_forward_max_ms=5.0,
                          grammar_compile_max_memory_mb=64)
    runner = make_grammar_runner(cfg, Tokenizer(str(tiny_chat_model)), 49152, [0])
    try:
        assert runner.jump_max_tokens == 16 and runner.jump_max_s == 0.005
        assert runner.compiles is not None and runner.compiles.max_memory_mb == 64
    finally:
        runner.shutdown()


# -- the server, its engine process limited -----------------------------------------------------
def _engine_process(server: ServerProcess) -> psutil.Process:
    assert server.proc is not None
    kids = psutil.Process(server.proc.pid).children(recursive=True)
    engines = [p for p in kids if "grammar.compile_worker" not in " ".join(p.cmdline())]
    return max(engines, key=lambda p: p.memory_info().rss)  # (not the multiprocessing resource tracker)


@pytest.fixture(scope="module")
def server(tiny_chat_model: Path) -> ServerProcess:
    args = ["--model-path", str(tiny_chat_model), "--max-total-tokens", "2048", "--context-length", "256",
            "--grammar-compile-workers", "1"]
    with running_server(args) as s:
        for p in [psutil.Process(s.proc.pid), *psutil.Process(s.proc.pid).children(recursive=True)]:
            _limit_address_space(p)  # the compile worker, started later, inherits the engine's
        yield s
        body = s.check_integrity()
        assert body["ok"] and body["running"] == body["waiting"] == 0, body


def _generate(server: ServerProcess, params: dict, text: str = "Hi") -> httpx.Response:
    return httpx.post(server.url + "/generate", timeout=300,
                      json={"text": text, "sampling_params": {"temperature": 0, **params}})


def _chat(server: ServerProcess, response_format: dict) -> httpx.Response:
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0,
        "response_format": response_format})


def _check_generate(r: httpx.Response, unit: str) -> None:
    if r.status_code == 400:  # refused: the message names the limit
        assert "grammar_" in r.json()["error"]["message"], r.text
        return
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["meta_info"]["finish_reason"]["type"] == "length", body
    assert body["text"] and _is_prefix_of_repeats(body["text"], unit), body


def test_recursive_grammars_are_answered_while_others_run(server: ServerProcess) -> None:
    engine = _engine_process(server)
    assert _generate(server, {"max_new_tokens": 2, "regex": "[0-9]"}).status_code == 200  # compile worker up
    rss0 = engine.memory_info().rss
    schema = json.dumps(RECURSIVE_SCHEMA)
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": RECURSIVE_SCHEMA}}
    with ThreadPoolExecutor(6) as pool:
        hostile = {
            "json_schema": pool.submit(_generate, server, {"max_new_tokens": 8, "json_schema": schema}),
            "ebnf": pool.submit(_generate, server, {"max_new_tokens": 8, "ebnf": RECURSIVE_EBNF}),
            "doubling": pool.submit(_generate, server, {"max_new_tokens": 8, "ebnf": DOUBLING_EBNF}),
            "response_format": pool.submit(_chat, server, rf),
        }
        plain = [pool.submit(_generate, server, {"max_new_tokens": 8}, f"plain {i}") for i in range(2)]
        _check_generate(hostile["json_schema"].result(), JSON_UNIT)
        _check_generate(hostile["ebnf"].result(), EBNF_UNIT)
        _check_generate(hostile["doubling"].result(), "Q")
        r = hostile["response_format"].result()
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        content = choice["message"]["content"]
        assert choice["finish_reason"] == "length" and _is_prefix_of_repeats(content, JSON_UNIT), r.text
        for f in plain:
            assert f.result().status_code == 200, f.result().text
    # the server, its engine and its memory survive
    assert engine.is_running() and _engine_process(server).pid == engine.pid
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = _generate(server, {"max_new_tokens": 4, "regex": "[a-c]{4}"})
    assert r.status_code == 200 and len(r.json()["text"]) >= 4, r.text
    assert engine.memory_info().rss - rss0 < RSS_GROWTH_BOUND, (rss0, engine.memory_info().rss)


# -- the compile's memory budget -----------------------------------------------------------------
def _memory_hungry_ebnf(n: int = 1600) -> str:
    """~23 KB that takes a compile worker ~14 MB (and ~3 s): n elements, each with its own mask."""
    cs = string.ascii_letters + string.digits
    return "root ::= " + " ".join(f'[^{cs[i % 62]}{cs[(i * 7) % 62]}]* "{cs[i % 62]}{i}"' for i in range(n))


def test_compile_over_its_memory_budget_is_a_400(tiny_chat_model: Path) -> None:
    args = ["--model-path", str(tiny_chat_model), "--max-total-tokens", "2048", "--context-length", "256",
            "--grammar-compile-workers", "1", "--grammar-compile-max-memory-mb", "6"]
    with running_server(args) as s:
        assert _generate(s, {"max_new_tokens": 3, "regex": "[0-9]{3}"}).status_code == 200  # small: within 6 MB
        r = _generate(s, {"max_new_tokens": 2, "ebnf": _memory_hungry_ebnf()})
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert "memory limit of 6 MB" in msg and "grammar_compile_max_memory_mb" in msg, msg
        assert "needed more than 6 MB to compile: its worker was killed" in s.log()
        again = _generate(s, {"max_new_tokens": 2, "ebnf": _memory_hungry_ebnf()})  # cached: no second trial
        assert again.status_code == 400 and "grammar_compile_max_memory_mb" in again.json()["error"]["message"]
        assert s.log().count("its worker was killed") == 1
        r = _generate(s, {"max_new_tokens": 3, "regex": "[a-c]{3}"})  # on a new worker
        assert r.status_code == 200 and len(r.json()["text"]) >= 3, r.text
        body = s.check_integrity()
        assert body["ok"] and body["running"] == body["waiting"] == 0, body
