"""Real servers sharing one real Mooncake master (in a network namespace of their own):
B hits KV that A computed; the master killed mid-load fails no request; hits resume after."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.model_utils import tiny_model
from harness.netns import run_mooncake_script

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_two_servers_share_mooncake(tmp_path):
    # a context of 4,096: C's blocking request decodes long enough that the queued requests' prefetches land
    # before it ends (with 512 it ended in about a second, and a slow lookup let them be admitted first)
    model = tiny_model(tmp_path / "model", with_tokenizer=True, max_position_embeddings=4096)
    res = run_mooncake_script(Path(__file__).parent / "mooncake_two_servers.py", str(model), str(tmp_path))
    assert res["a_stored"], res
    assert res["b_same_output"], res
    assert res["b_storage_hit_tokens"] > 0, res  # B served KV that A computed (prefetch policy timeout)
    assert not res["c_blocker_ended_early"], res  # the scenario held: the requests queued behind the blocker
    assert res["c_prefetched_while_queued"], res  # C (best_effort): prefetches land while requests queue
    assert res["c_same_output"] and res["c_storage_hit_tokens"] > 0, res  # and they take them
    assert res["c_integrity"] and res["c_exit"] == 0, res
    assert res["statuses_during_master_kill"] and all(s == 200 for s in res["statuses_during_master_kill"]), res
    assert res["healthy_after_kill"], res
    assert res["errors_counted"] > 0, res
    assert res["hits_resume"], res
    assert all(res["integrity"]), res
    assert res["exit_codes"] == [0, 0], res
