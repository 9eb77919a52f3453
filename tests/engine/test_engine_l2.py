"""L2 host tier in the engine: KV demoted from L1 comes back by copy, outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from harness.engine_cases import GREEDY, ids_of, tier_prompts
from harness.model_utils import hf_greedy, tiny_model
from hicache.tiers.device import KVLayout
from hicache.tiers.host import make_host_pool
from serving.engine import Engine
from serving.kernels.page_copy import device_to_host, host_to_device


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_model(tmp_path_factory.mktemp("l2"))
    ps, others = tier_prompts()
    return path, ps, others, hf_greedy(path, ps, GREEDY["max_new_tokens"])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_host_pool_round_trip(layout):
    lay = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    kv = torch.randn(2, 3, 10, 4, 2, 8)
    host = make_host_pool(layout, lay, 12, 4)
    device_to_host(kv, host, [7, 2, 5], [0, 11, 3])
    back = torch.zeros_like(kv)
    host_to_device(host, back, [0, 11, 3], [1, 2, 3])
    assert torch.equal(back[:, :, 1], kv[:, :, 7])
    assert torch.equal(back[:, :, 2], kv[:, :, 2])
    assert torch.equal(back[:, :, 3], kv[:, :, 5])
    assert torch.equal(back[:, :, 0], torch.zeros_like(back[:, :, 0]))
    if layout == "page_first":  # a page is contiguous across layers, ready for L3
        assert len(host.page_bytes(11)) == host.bytes_per_page


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_prefix_comes_back_from_l2(tiny, policy, layout):
    path, ps, others, ref = tiny
    # L1 holds ~2 requests; L2 holds 4x that.
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=160, hicache_ratio=4.0,
                 hicache_write_policy=policy, hicache_mem_layout=layout, write_through_threshold=1,
                 max_running_requests=2)
    first = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(first) == ref
    eng.check_integrity()
    eng.generate(input_ids=others, sampling_params=GREEDY)  # pushes ps out of L1
    eng.check_integrity()
    core = eng.core
    assert core.tree.cached_pages("host") > 0
    again = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(again) == ref
    host_hits = sum(o["meta_info"]["cached_tokens_details"]["host"] for o in again)
    assert host_hits > 0, [o["meta_info"] for o in again]
    assert core.controller.pages_loaded > 0
    for p, o in zip(ps, again, strict=True):
        assert o["meta_info"]["cached_tokens"] <= len(p) - 1
    eng.check_integrity()
    eng.shutdown()


def test_l1_only_recomputes_what_l2_would_keep(tiny):
    path, ps, others, ref = tiny
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=160, max_running_requests=2)
    eng.generate(input_ids=ps, sampling_params=GREEDY)
    eng.generate(input_ids=others, sampling_params=GREEDY)
    again = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(again) == ref
    assert sum(o["meta_info"]["cached_tokens_details"]["host"] for o in again) == 0
    eng.check_integrity()
