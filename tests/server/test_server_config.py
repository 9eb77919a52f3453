"""Config files, CLI flags and the wire format (no server started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.server_utils import ROOT
from serving import ipc as m
from serving.launch import cli
from serving.server.config import ConfigError, ServerConfig, load_config
from serving.structs.bootstrap import Bootstrap
from serving.structs.logprob_options import LogprobOptions
from serving.structs.sampling_params import SamplingParams


@pytest.mark.parametrize("name", ["l3.yaml", "l1.yaml"])
def test_shipped_configs_validate(name: str) -> None:
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.engine.model.model_path == "models/SmolLM2-135M-Instruct"
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 30000)


@pytest.mark.parametrize(
    "text,words",
    [
        ("cache:\n  page_sise: 16\n", ["cache.page_sise", "Extra inputs"]),
        ("server:\n  port: abc\n", ["server.port", "integer"]),
        ("scheduler:\n  max_running_requests: '8'\n", ["scheduler.max_running_requests"]),
        ("cache:\n  page_size: 0\n", ["cache", "page_size must be positive"]),
        ("model:\n  dtype: float64\n", ["model", "dtype"]),
        ("server:\n  log_level: loud\n", ["server", "log_level"]),
        ("storage:\n  path: /tmp\n", ["storage"]),
        ("- a\n- b\n", ["mapping"]),
        ("model: [1\n", ["invalid YAML"]),
    ],
)
def test_bad_config_names_the_field(tmp_path: Path, text: str, words: list[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    for word in words:
        assert word in str(e.value)
    assert str(path) in str(e.value)


def _config(argv: list[str]):  # noqa: ANN202
    parser, dests = cli.build_parser()
    args = parser.parse_args(["serve", *argv])
    return load_config(args.config, cli._overrides(args, dests))


def test_flags_override_the_file() -> None:
    cfg = _config(
        [
            "--config",
            "configs/l3.yaml",
            "--port",
            "31000",
            "--page-size",
            "32",
            "--api-key",
            "k",
            "--max-running-requests",
            "4",
            "--hicache-ratio",
            "2.5",
            "--enable-debug-endpoints",
            "--context-length",
            "1024",
            "--schedule-policy",
            "fcfs",
        ]
    )
    assert cfg.server.port == 31000 and cfg.server.api_key == "k" and cfg.server.enable_debug_endpoints
    assert cfg.engine.cache.page_size == 32 and cfg.engine.cache.hicache_ratio == 2.5
    assert cfg.engine.scheduler.max_running_requests == 4 and cfg.engine.scheduler.schedule_policy == "fcfs"
    assert cfg.engine.model.context_length == 1024
    assert cfg.engine.model.served_model_name == "SmolLM2-135M-Instruct"  # from the file


def test_defaults_come_from_the_dataclasses() -> None:
    cfg = _config([])
    assert cfg.server == ServerConfig()
    parser, _ = cli.build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    help_text = serve.format_help()
    for flag in (
        "--model-path",
        "--host",
        "--port",
        "--api-key",
        "--page-size",
        "--max-total-tokens",
        "--hicache-ratio",
        "--hicache-size",
        "--hicache-write-policy",
        "--max-running-requests",
        "--chunked-prefill-size",
        "--schedule-policy",
        "--attention-backend",
        "--load-format",
        "--dtype",
        "--device",
        "--context-length",
        "--served-model-name",
        "--log-level",
    ):
        assert flag in help_text, flag
    assert f"default: {ServerConfig().port}" in help_text


def test_cli_errors_and_stubs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("server:\n  prot: 1\n")
    assert cli.main(["serve", "--config", str(bad)]) == 2
    assert "server.prot" in capsys.readouterr().err
    assert cli.main(["serve", "--port", "70000"]) == 2
    assert "port" in capsys.readouterr().err
    assert cli.main(["router", "--port", "70000"]) == 2  # the router's config is validated too
    assert "port" in capsys.readouterr().err
    parser, _ = cli.build_parser()
    args = parser.parse_args(["convert", "in.gguf", "out"])
    assert args.paths == ["in.gguf", "out"] and args.dtype == "float32"


def test_messages_round_trip() -> None:
    msgs = [
        m.GenerateReq("r1", [1, 2, 3], SamplingParams(max_new_tokens=4, stop=("x",), seed=3), session_id="s"),
        m.GenerateReq("r3", [4], SamplingParams(), bootstrap=Bootstrap("10.0.0.2", 8998, 7),
                      logprobs=LogprobOptions(0, 2, (5, 6))),
        m.TokenOut(
            "r1",
            0,
            [5, 6],
            prompt_tokens=3,
            cached_tokens=0,
            cached_by_tier={"device": 0},
            finish_reason={"type": "stop", "matched": 6},
        ),
        m.Error(404, "unknown session_id 's'", rid="r1"),
        m.Result(7, {"ok": True}),
        m.Shutdown(),
    ]
    assert m.decode(m.encode(msgs)) == msgs
    with pytest.raises(OverflowError):
        m.pack(m.GenerateReq("r2", [10**30], SamplingParams()))


def test_watchdog_and_limit_flags() -> None:
    cfg = _config(["--watchdog-timeout", "5", "--engine-call-timeout-s", "2.5", "--max-json-depth", "32"])
    assert (cfg.server.watchdog_timeout, cfg.server.engine_call_timeout_s, cfg.server.max_json_depth) == (5, 2.5, 32)
    assert ServerConfig().watchdog_timeout == 300 and ServerConfig().engine_call_timeout_s == 60
    for bad in (["--watchdog-timeout", "0"], ["--engine-call-timeout-s", "-1"], ["--max-json-depth", "1"]):
        with pytest.raises(ConfigError):
            _config(bad)


def test_api_key_from_the_environment(tmp_path: Path) -> None:
    """HICACHE_API_KEY keeps the key out of ps: the flag wins over it, it wins over the file."""
    parser, dests = cli.build_parser()

    def key(argv: list[str], environ: dict[str, str]) -> str | None:
        args = parser.parse_args(["serve", *argv])
        return load_config(args.config, cli.serve_overrides(args, dests, environ)).server.api_key

    file = tmp_path / "k.yaml"
    file.write_text("server:\n  api_key: from-file\n")
    env = {"HICACHE_API_KEY": "from-env"}
    assert key([], env) == "from-env"
    assert key(["--api-key", "from-flag"], env) == "from-flag"
    assert key(["--config", str(file)], env) == "from-env"
    assert key(["--config", str(file)], {}) == "from-file"
    assert key([], {}) is None and key([], {"HICACHE_API_KEY": ""}) is None
