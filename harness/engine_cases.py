"""The engine tests' shared cases: greedy sampling params, random prompts, the tier scenarios' prompts."""

from __future__ import annotations

import random

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def tier_prompts() -> tuple[list[list[int]], list[list[int]]]:
    """The tier scenarios' prompts: 4 that come back, and 6 others that push them out of L1."""
    return prompts(4, 512, seed=3, lo=40, hi=60), prompts(6, 512, seed=4, lo=40, hi=60)


def window_case(arch: str, where, max_new_tokens: int) -> tuple:  # noqa: ANN001 (a Path)
    """A sliding-window model's tier scenario: (arch, a tiny random checkpoint of ``arch`` in ``where``, the
    tier prompts, the others, HF's greedy tokens for each)."""
    from harness.model_utils import hf_greedy, tiny_model

    path = tiny_model(where, arch)
    ps, others = tier_prompts()
    return arch, path, ps, others, hf_greedy(path, ps, max_new_tokens), hf_greedy(path, others, max_new_tokens)


def ids_of(outs):
    return [o["output_ids"] for o in outs]


def generate_checked(eng, prompts: list[list[int]], params: dict) -> list[dict]:  # noqa: ANN001 (an Engine)
    """``eng.generate`` with ``check_integrity()`` after every engine step (the offline engine's step hook)."""
    core = eng.core
    step = core.step

    def checked():  # noqa: ANN202
        out = step()
        core.check_integrity()
        return out

    core.step = checked
    try:
        return eng.generate(input_ids=prompts, sampling_params=params)
    finally:
        core.step = step



def hits(outs: list[dict], tier: str) -> list[int]:
    """Each output's cached tokens from ``tier`` (device, host, storage)."""
    return [o["meta_info"]["cached_tokens_details"][tier] for o in outs]


def lmdb_l3(db, **extra) -> dict:  # noqa: ANN001 (a path)
    """An Engine's options for a small LMDB L3 at ``db`` that prefetches whole matches (wait_complete)."""
    return dict(hicache_storage_backend="lmdb",
                hicache_storage_backend_extra_config={"path": str(db), "capacity_gb": 0.05, "initial_map_mb": 1,
                                                      **extra},
                hicache_storage_prefetch_policy="wait_complete", hicache_storage_prefetch_threshold=8,
                hicache_storage_prefetch_timeout_base=30.0, hicache_storage_load_policy="always_load")
