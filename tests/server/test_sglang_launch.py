"""SGLang launch lines (serving/launch/sglang_compat.py): ``python -m serving.launch_server`` with a
realistic SGLang HiCache line (``--enable-hierarchical-cache``, ``--trust-remote-code``, ``--tp``,
``--hicache-storage-backend file`` ...) starts and answers, each flag's one line is in the log;
``--disable-radix-cache`` really reports no cached tokens; a refused flag and an unknown flag fail in
one line; ``/flush_cache?clear_storage=true`` (and SGLang's ``/clear_hicache_storage_backend``)
empties the LMDB L3: a repeated prompt then gets no storage hits, where a plain flush leaves them;
a list of SGLang launch lines as its docs write them each becomes a config or fails in one line."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from harness.server_utils import ROOT, ServerProcess, running_server
from serving.tokenizer import Tokenizer

# runs `python -m serving.launch_server ARGS` in place of `python -m serving.launch.cli serve ARGS`
LAUNCH_SERVER = ["sh", "-c", 'p="$0"; shift 3; exec "$p" -m serving.launch_server "$@"']
TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}<<assistant>>"
PROMPT = [(i * 37) % 5000 + 100 for i in range(160)]  # 10 pages of 16


def generate(s, ids: list[int]) -> dict:
    r = httpx.post(s.url + "/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 2}})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def pages_written(s) -> int:
    info = httpx.get(s.url + "/get_server_info", timeout=30).json()
    return int(info["internal_states"][0]["storage"]["pages_written"])


def wait_written(s, at_least: int) -> None:
    deadline = time.monotonic() + 60
    while pages_written(s) < at_least:
        assert time.monotonic() < deadline, f"the L3 write-back did not finish: {pages_written(s)} pages"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def sglang_server(tiny_chat_model, tmp_path_factory):
    l3 = tmp_path_factory.mktemp("file-backend")
    template = tmp_path_factory.mktemp("tmpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ["--model-path", str(tiny_chat_model), "--tp", "1", "--trust-remote-code", "--enable-metrics",
            "--enable-hierarchical-cache", "--hicache-io-backend", "kernel", "--hicache-write-policy",
            "write_through", "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy",
            "wait_complete", "--hicache-storage-load-policy", "always_load", "--page-size", "16",
            "--hicache-storage-prefetch-threshold", "16",
            "--max-total-tokens", "2048", "--max-prefill-tokens", "512", "--stream-interval", "2",
            "--chat-template", str(template), "--served-model-name", "tiny", "--log-level", "info"]
    server = ServerProcess(args)
    server.prefix = LAUNCH_SERVER
    server.env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(l3)
    server.start()
    try:
        yield server, l3
    finally:
        assert server.stop() == 0, server.log()


def test_an_sglang_launch_line_starts_and_answers(sglang_server, tiny_chat_model) -> None:
    s, l3 = sglang_server
    log = s.log()
    for flag in ("--trust-remote-code", "--enable-metrics", "--hicache-io-backend", "--stream-interval"):
        assert f"hicache serve: {flag}: accepted, no effect here" in log, flag
    assert "--enable-hierarchical-cache: L2 (host memory) on" in log
    assert "--max-prefill-tokens: prefill tokens per step capped at 512" in log
    assert f"--hicache-storage-backend file: mapped to the embedded LMDB store at {l3}" in log
    info = httpx.get(s.url + "/get_server_info", timeout=30).json()
    assert info["cache"]["hicache_ratio"] == 2.0 and info["cache"]["hicache_storage_backend"] == "lmdb"
    assert info["scheduler"]["chunked_prefill_size"] == 512
    r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    rendered = Tokenizer(str(tiny_chat_model)).hf.encode("<<user>> hi\n<<assistant>>", add_special_tokens=False)
    assert r.json()["usage"]["prompt_tokens"] == len(rendered)  # the --chat-template file rendered the prompt
    assert httpx.get(s.url + "/metrics", timeout=30).status_code == 200


def test_flush_cache_clear_storage_empties_l3(sglang_server) -> None:
    s, _ = sglang_server
    generate(s, PROMPT)
    generate(s, PROMPT)  # write_through: the hit backs the prompt up to L2, then on to L3
    wait_written(s, (len(PROMPT) - 1) // 16)  # the hit: every full page but the last token's
    assert httpx.post(s.url + "/flush_cache", timeout=60).json()["success"]
    again = generate(s, PROMPT)
    assert again["cached_tokens_details"]["storage"] > 0, again  # a plain flush leaves L3 (as SGLang's)
    r = httpx.post(s.url + "/flush_cache", params={"clear_storage": "true"}, timeout=60)
    assert r.status_code == 200 and r.json()["cleared_storage"] is True, r.text
    after = generate(s, PROMPT)
    assert after["cached_tokens"] == 0 and after["cached_tokens_details"]["storage"] == 0, after
    written = pages_written(s)
    generate(s, PROMPT)  # the hit writes it to L3 again
    wait_written(s, written + 1)
    r = httpx.post(s.url + "/clear_hicache_storage_backend", timeout=60)  # SGLang's route
    assert r.status_code == 200 and r.json()["cleared_storage"] is True, r.text
    assert generate(s, PROMPT)["cached_tokens"] == 0
    assert s.check_integrity()["ok"]


def test_clear_storage_without_l3_is_a_400(tiny_chat_model) -> None:
    with running_server(["--model-path", str(tiny_chat_model), "--disable-radix-cache", "--page-size", "16",
                         "--max-total-tokens", "1024"]) as s:
        r = httpx.post(s.url + "/flush_cache", params={"clear_storage": "true"}, timeout=30)
        assert r.status_code == 400 and "no L3" in r.text, r.text
        first = generate(s, PROMPT)
        second = generate(s, PROMPT)  # --disable-radix-cache: no prefix reuse
        assert first["cached_tokens"] == second["cached_tokens"] == 0, second
        assert s.check_integrity()["ok"]


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving.launch_server", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize(("args", "line"), [
    (["--no-such-flag"], "hicache serve: error: unrecognized arguments: --no-such-flag"),
    (["--skip-tokenizer-init"], "hicache serve: --skip-tokenizer-init is not supported here: the tokenizer"),
    (["--nnodes", "2"], "hicache serve: --nnodes is not supported here: one node only"),
    (["--disable-radix-cache", "--enable-hierarchical-cache"], "disable_radix_cache turns prefix reuse off"),
    (["--chat-template", "chatml"], "hicache serve: --chat-template chatml: cannot read it"),
])
def test_refused_and_unknown_flags_fail_in_one_line(tiny_chat_model, args, line) -> None:
    out = launch("--model-path", str(tiny_chat_model), *args)
    assert out.returncode == 2, out
    assert line in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


# SGLang launch lines as its docs write them (HiCache's pages, the server-arguments page, PD, tools):
# each becomes a config (with one line per compatibility flag) or fails with its one line.
LINES = [
    ("--enable-hierarchical-cache --hicache-ratio 2 --hicache-size 0 --hicache-write-policy write_through "
     "--page-size 64", None, ["--enable-hierarchical-cache: turns L2 on"]),
    ("--enable-hierarchical-cache --page-size 64 --hicache-storage-backend mooncake --hicache-mem-layout "
     "page_first --hicache-io-backend direct --hicache-storage-prefetch-policy timeout", None,
     ["--enable-hierarchical-cache: L2 (host memory) on", "--hicache-io-backend: accepted, no effect here"]),
    ("--enable-hierarchical-cache --hicache-storage-backend file --hicache-write-policy write_back", None,
     ["--hicache-storage-backend file: mapped to the embedded LMDB store"]),
    ("--enable-hierarchical-cache --hicache-storage-backend hf3fs",
     "hicache_storage_backend must be one of lmdb, mooncake", []),
    ("--tool-call-parser qwen25 --reasoning-parser qwen3 --grammar-backend llguidance", None, []),
    ("--mem-fraction-static 0.85 --context-length 2048 --max-running-requests 64 --chunked-prefill-size 4096 "
     "--schedule-policy lpm --random-seed 1 --log-level warning --host 127.0.0.1 --port 30000", None, []),
    ("--attention-backend triton --disable-cuda-graph --cuda-graph-max-bs 32 --kv-cache-dtype fp8_e4m3 "
     "--dtype bfloat16 --enable-torch-compile", None, ["--enable-torch-compile: accepted, no effect here"]),
    ("--speculative-algorithm NGRAM --speculative-num-draft-tokens 8", None, []),
    ("--tp 2 --dp 2 --trust-remote-code", None, ["--trust-remote-code: accepted, no effect here"]),
    ("--disaggregation-mode prefill --disaggregation-transfer-backend nixl", None, []),
    ("--enable-lora --lora-paths a=b", "--enable-lora is not supported here: LoRA adapters are not supported", []),
    ("--nnodes 2 --node-rank 1", "--nnodes is not supported here: one node only", []),
]


@pytest.mark.parametrize(("line", "error", "notes"), LINES)
def test_sglang_launch_lines_map_or_fail_in_one_line(tiny_chat_model, line: str, error: str | None,
                                                     notes: list[str]) -> None:
    import shlex

    from serving.launch import cli, sglang_compat
    from serving.server.config import ConfigError

    args, dests = cli.parse(["serve", "--model-path", str(tiny_chat_model), *shlex.split(line)])
    overrides = cli.serve_overrides(args, dests, {})
    try:
        got = sglang_compat.apply(args, overrides)
        cli.load_config(args.config, overrides)
    except ConfigError as e:
        assert error is not None and error in str(e) and "\n" not in str(e), e
        return
    assert error is None, f"expected {error!r}"
    for note in notes:
        assert any(n.startswith(note) for n in got), (note, got)


def test_every_sglang_flag_parses_into_a_config_or_one_line(tiny_chat_model, capsys) -> None:
    """No flag of SGLang's launch_server (serving/launch/sglang_flags.json: all of its release's) is an
    "unrecognized argument": each parses, then works, changes nothing (one line) or is refused in one
    line. Values are placeholders: a config field may refuse "1" (its own message), never the flag."""
    from serving.launch import cli, sglang_compat
    from serving.launch.sglang_flags import sglang_flags
    from serving.server.config import ConfigError

    release, flags = sglang_flags()
    assert len(flags) > 500, release
    refused = 0
    for name, nargs in flags.items():
        argv = ["serve", "--model-path", str(tiny_chat_model), f"--{name}", *([] if nargs in (0, "?", "*") else ["1"])]
        try:
            args, dests = cli.parse(argv)
        except SystemExit:
            err = capsys.readouterr().err
            assert "unrecognized" not in err and "ambiguous" not in err, (name, err)
            continue
        try:
            sglang_compat.apply(args, cli.serve_overrides(args, dests, {}))
        except ConfigError as e:
            assert "\n" not in str(e), (name, e)
            refused += str(e).startswith(f"--{name} (SGLang")
    assert refused > 300, refused  # most of SGLang's flags have no counterpart here


def test_the_flag_list_is_the_installed_sglangs() -> None:
    pytest.importorskip("sglang.srt.server_args", exc_type=ImportError)
    from serving.launch.sglang_flags import generate, sglang_flags

    want = generate()
    assert (want["release"], want["flags"]) == sglang_flags(), "regenerate: python -m serving.launch.sglang_flags"
