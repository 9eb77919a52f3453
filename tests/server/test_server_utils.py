"""The test harness itself: a server that fails to start takes the ones started with it down."""

from __future__ import annotations

import pytest

from harness.server_utils import ServerProcess, start_all


def test_start_all_stops_the_others_when_one_fails(tiny_chat_model) -> None:
    good = ServerProcess(["--model-path", str(tiny_chat_model), "--max-total-tokens", "1024"])
    bad = ServerProcess(["--model-path", str(tiny_chat_model), "--page-size", "0"])
    with pytest.raises(RuntimeError, match="did not start"):
        start_all(good, bad)
    assert good.proc is not None and good.proc.poll() is not None  # not left running
