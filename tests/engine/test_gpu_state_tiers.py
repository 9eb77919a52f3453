"""State snapshots through the tiers on CUDA (issue 43): tiny random Qwen3.5 and Nemotron-H in float32, pinned
L2 and an LMDB L3. The snapshot copies between the L1 and L2 state pools are queued on the CUDA stream there
(serving/cache/cache_controller.py, the host waiting only where it touches a slot: HostStatePool.settle),
which the CPU suite cannot run: a second turn served from L1, from L2 (L1 flushed) and from L3 after a
restart gives the same greedy tokens as the same engine cold, and those are HF's. Skips without CUDA
(tests/engine/test_engine_state_l3.py runs the tiers on CPU)."""

from __future__ import annotations

import pytest
import torch

from harness.engine_cases import lmdb_l3
from harness.model_utils import tiny_model
from harness.state_cases import GREEDY, STATE_FAMILIES, two_turns
from serving.engine import Engine

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("family", sorted(STATE_FAMILIES))
def test_second_turns_from_every_tier_match_cold_on_cuda(tmp_path, family: str) -> None:
    path = tiny_model(tmp_path, family, **STATE_FAMILIES[family])
    first, _, second, ref2 = two_turns(path, 3, seed=15)
    kw = dict(model_path=str(path), page_size=4, dtype="float32", device=DEVICE, max_total_tokens=1024)
    cold = Engine(**kw)
    want = [cold.generate(input_ids=[p], sampling_params=GREEDY)[0]["output_ids"] for p in second]
    cold.shutdown()
    assert want == ref2
    tiers = dict(kw, hicache_ratio=2.0, **lmdb_l3(tmp_path / "l3"))
    eng = Engine(**tiers)
    for p in first:
        eng.generate(input_ids=[p], sampling_params=GREEDY)
    got = [eng.generate(input_ids=[second[0]], sampling_params=GREEDY)[0]]
    eng.check_integrity()
    eng.core.tree.evict_device(eng.core.tree.cached_pages("device"))
    eng.core.req_cache.flush_transfers()
    got.append(eng.generate(input_ids=[second[1]], sampling_params=GREEDY)[0])
    eng.check_integrity()
    eng.shutdown()  # persists pages and snapshots to L3
    eng = Engine(**tiers)
    got.append(eng.generate(input_ids=[second[2]], sampling_params=GREEDY)[0])
    eng.check_integrity()
    eng.shutdown()
    assert [o["output_ids"] for o in got] == want
    tiers_hit = [next(t for t in ("device", "host", "storage") if o["meta_info"]["cached_tokens_details"][t])
                 for o in got]
    assert tiers_hit == ["device", "host", "storage"]
