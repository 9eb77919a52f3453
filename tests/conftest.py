"""Shared fixtures (keep small)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# One intra-op thread per process: the suite runs two test processes (pytest-xdist) on a 2-core
# machine, each with engines and servers of its own; two threads each oversubscribe the cores
# (a decode step of SmolLM2 in fp32 is faster on one thread than on two, even alone). Set before
# torch is imported here; the servers a test starts inherit it (harness/server_utils.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every process a test starts (servers, tensor-parallel ranks, scripts) prints the Python stack of each
# thread if it dies of a signal (SIGSEGV, SIGBUS, ...): its stderr, which the failing test shows.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

# Modules whose assertions depend on timing on this 2-core machine (a latency bound, a throttled
# store against the prefill rate, a watchdog's deadline, a stream cut after so many tokens):
# `make test` runs them alone, after the rest has run two at a time (pytest-xdist).
SERIAL_MODULES = frozenset({
    "test_soak.py", "test_cost_model.py", "test_storage_nonblocking.py", "test_server_watchdog.py",
    "test_engine_watchdog.py", "test_server_streams.py", "test_storage_mooncake.py", "test_agent_prefetch.py",
    "test_server_hardening.py", "test_grammar_http.py",
})


@pytest.hookimpl(optionalhook=True)  # known only where xdist is loaded
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201
    """``--dist loadfile`` that finishes the run when a worker crashes (harness/xdist_sched.py)."""
    from harness.xdist_sched import make_scheduler

    return make_scheduler(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:  # noqa: ANN001
    """A test its worker died in runs once more; a second crash fails it (harness/xdist_sched.py)."""
    from harness.xdist_sched import rerun_once

    rerun_once(crashitem, report, sched)


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001
    from harness.xdist_sched import summarize_reruns

    summarize_reruns(terminalreporter)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``-m serial`` (`make test`'s second phase) only SERIAL_MODULES are imported: the other
    ~110 test modules cost that process ~12 s to import, to be deselected."""
    if config.getoption("markexpr", "") == "serial" and collection_path.suffix == ".py" \
            and collection_path.name.startswith("test_") and collection_path.name not in SERIAL_MODULES:
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
    # The modules with slow tests first (the rest keeps its order): `make test` hands whole files to
    # two workers in this order (`--dist loadfile --no-loadscope-reorder`), so the short ones even
    # out the end instead of one worker idling while the other runs a PD cluster.
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (fast server tests)."""
    from harness.model_utils import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny-chat"), with_tokenizer=True, max_position_embeddings=512)


@pytest.fixture(scope="session")
def lang_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model with SmolLM2's real EOS (``<|im_end|>``, a special token, so its text
    never shows), for serving.lang's and the grammar tests."""
    from harness.model_utils import tiny_model

    return tiny_model(tmp_path_factory.mktemp("lang-chat"), with_tokenizer=True, max_position_embeddings=512,
                      eos_token_id=2)
