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


def ids_of(outs):
    return [o["output_ids"] for o in outs]
