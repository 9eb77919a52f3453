"""Shutdown with L3 (issue 11, item 9): the engine persists every cached page and reports
exactly how many it could not write; the HTTP side waits ``shutdown_timeout_s`` for it and
says so when it has to kill it anyway."""

from __future__ import annotations

import logging
from multiprocessing import Pipe

import pytest

from harness.model_utils import tiny_model
from serving.engine.offline import Engine, config_from_kwargs
from serving.engine.shutdown import shutdown_core
from serving.launch import cli
from serving.server.config import ServerConfig, load_config
from serving.server.engine_client import EngineClient

PS = 4
PROMPTS = [[(k * 37 + i * 7) % 500 + 1 for i in range(30 + 5 * k)] for k in range(3)]
PARAMS = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("persist"))


def l3_engine(path, db) -> Engine:
    return Engine(model_path=str(path), page_size=PS, max_total_tokens=256, hicache_ratio=2.0,
                  hicache_storage_backend="lmdb",
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1})


def tree_pages(eng: Engine) -> tuple[int, int]:
    nodes = eng.core.tree.nodes()
    return sum(len(nd.key) // PS for nd in nodes), len(nodes)


def test_shutdown_persists_every_page_and_says_so(path, tmp_path, caplog):
    eng = l3_engine(path, tmp_path / "l3")
    eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    total, _ = tree_pages(eng)
    assert total > 0
    with caplog.at_level(logging.INFO, logger="hicache.engine"):
        report = shutdown_core(eng.core)
    assert (report.persisted, report.not_written, report.error) == (total, 0, None)
    assert 0 < report.written_now <= total
    assert f"persisted {total} pages to L3, 0 not written" in caplog.text


def test_shutdown_counts_the_pages_it_could_not_write(path, tmp_path, caplog):
    """A store that refuses every write: no page reaches L3, and the report says how many."""
    eng = l3_engine(path, tmp_path / "l3")
    eng.core.storage.tier.batch_set = lambda keys, pool, pages: 0
    eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)  # hits: backups and write-backs before shutdown
    with caplog.at_level(logging.INFO, logger="hicache.engine"):
        report = shutdown_core(eng.core)
    total, _ = tree_pages(eng)
    assert total > 0
    assert (report.persisted, report.not_written, report.written_now) == (0, total, 0)
    assert f"persisted 0 pages to L3, {total} not written" in caplog.text
    assert any(r.levelno == logging.WARNING and "not written" in r.getMessage() for r in caplog.records)


def test_broken_tree_is_not_persisted(path, tmp_path):
    eng = l3_engine(path, tmp_path / "l3")
    eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    eng.core.runner.pool.allocator.alloc(1)  # a page nobody owns
    assert shutdown_core(eng.core) is None
    assert eng.core.storage.pages_written == 0


class StuckEngine:
    """Stands in for an engine process that never finishes its shutdown."""

    exitcode = -9

    def __init__(self) -> None:
        self.joins: list[float | None] = []
        self.killed = False

    def is_alive(self) -> bool:
        return not self.killed

    def join(self, timeout: float | None = None) -> None:
        self.joins.append(timeout)

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        self.killed = True


def test_stop_waits_shutdown_timeout_then_says_it_kills(tmp_path, caplog):
    engine = config_from_kwargs(model_path="unused", hicache_storage_backend="lmdb",
                                hicache_storage_backend_extra_config={"path": str(tmp_path)})
    client = EngineClient(engine, ServerConfig(shutdown_timeout_s=7.0), metrics=None)
    client.proc = StuckEngine()
    client.info = {"model_path": "unused"}  # it was ready (served): it has a cache to persist
    rx, client._tx_http = Pipe(duplex=False)
    with caplog.at_level(logging.INFO, logger="hicache.server"):
        assert client.stop() == -9
    assert client.proc.joins[0] == 7.0 and client.proc.killed
    assert "did not finish its shutdown within shutdown_timeout_s=7 s" in caplog.text
    assert "not yet written to L3 are lost" in caplog.text
    assert rx.poll(0)  # it was asked to shut down first


def test_shutdown_timeout_flag_and_default():
    assert ServerConfig().shutdown_timeout_s >= 120
    parser, dests = cli.build_parser()
    args = parser.parse_args(["serve", "--shutdown-timeout-s", "600"])
    assert load_config(args.config, cli._overrides(args, dests)).server.shutdown_timeout_s == 600
    with pytest.raises(ValueError, match="shutdown_timeout_s"):
        ServerConfig(shutdown_timeout_s=0)
