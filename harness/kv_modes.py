"""KV modes on a real engine: build one with a mode, count tier hits, check a mode against the reference."""

from __future__ import annotations

import torch

from harness.engine_cases import GREEDY, ids_of
from serving.engine import Engine


def make(path, db, mode: dict, layout: str = "page_first", **kw) -> Engine:
    # L1 holds ~2 requests, L2 several; every page reaching L2 is written on to L3
    return Engine(model_path=str(path), page_size=4, max_total_tokens=160, hicache_ratio=4.0,
                  hicache_mem_layout=layout, write_through_threshold=1, max_running_requests=2,
                  hicache_storage_backend="lmdb",
                  hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1},
                  hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=8,
                  hicache_storage_load_policy="always_load", **mode, **kw)


def tier_hits(outs, tier: str) -> int:
    return sum(o["meta_info"]["cached_tokens_details"][tier] for o in outs)


def l1_bytes(eng: Engine, tokens: list[int]) -> torch.Tensor:
    """The L1 bytes of the pages ``tokens`` hits on L1, every layer, K and V."""
    pages = eng.core.tree.match_prefix(tokens).device_pages
    assert pages
    buf = eng.core.runner.pool.kv_buffer
    return buf.view(torch.uint8)[:, :, pages].clone()


def check_mode(path, ps, others, ref, db, mode: dict, layout: str) -> list[list[int]]:
    eng = make(path, db, mode, layout)
    cold = ids_of(eng.generate(input_ids=ps, sampling_params=GREEDY))
    if not mode:
        assert cold == ref  # raw fp32 is HF's recompute
    before = l1_bytes(eng, ps[-1])  # the last prompt's pages are still on L1
    again = eng.generate(input_ids=ps[-1:], sampling_params=GREEDY)  # the rest were pushed down by now
    assert ids_of(again) == cold[-1:] and tier_hits(again, "device") > 0
    eng.generate(input_ids=others, sampling_params=GREEDY)  # pushes ps out of L1
    eng.check_integrity()
    back = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(back) == cold
    assert tier_hits(back, "host") > 0
    last = back[-1]["meta_info"]["cached_tokens_details"]
    assert last["device"] == 0 and last["host"] > 0, last
    n = last["host"] // 4  # its first n pages came back from L2 into other L1 pages
    assert torch.equal(l1_bytes(eng, ps[-1])[:, :, :n], before[:, :, :n])  # bit for bit
    eng.core.storage.poll(wait=True)
    eng.check_integrity()
    eng.shutdown()
    eng = make(path, db, mode, layout)  # a restart: L1 and L2 empty, L3 full
    outs = eng.generate(input_ids=ps, sampling_params=GREEDY)
    assert ids_of(outs) == cold
    assert tier_hits(outs, "storage") > 0
    assert eng.core.storage.tier.stats()["corrupt"] == 0
    eng.check_integrity()
    eng.shutdown()
    return cold
