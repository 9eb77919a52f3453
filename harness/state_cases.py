"""What the state-model tests share (Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba2; issue 43):
their tiny configs, two-turn conversations with HF's greedy answers, and a generate checked against
HF's tokens and log-probabilities."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from harness.engine_cases import ids_of, prompts
from harness.model_utils import hf_greedy, hf_output_logprobs

NEW = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
LOGPROB_TOL = 2e-3  # fp32, another summation order than HF's; a wrong state moves them by far more
# Qwen3.5's own mix (3 Gated DeltaNet layers to 1 gated attention); Nemotron-H with 3 Mamba2 layers in 7
STATE_FAMILIES = {"qwen3_5": {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
                  "nemotron_h": {"hybrid_override_pattern": "M*-MM*-", "time_step_min": 1e-9}}


def two_turns(path: Path, n: int, seed: int, vocab: int = 512) -> tuple[list, list, list, list]:
    """``n`` first turns (30-50 tokens), their second turns (first turn + its answer + 5-12 more tokens)
    and HF's greedy answers to both: (first, ref1, second, ref2)."""
    first = prompts(n, vocab, seed=seed, lo=30, hi=50)
    ref1 = hf_greedy(path, first, NEW)
    rng = random.Random(seed + 1)
    second = [p + a + [rng.randrange(1, vocab - 1) for _ in range(rng.randint(5, 12))]
              for p, a in zip(first, ref1, strict=True)]
    return first, ref1, second, hf_greedy(path, second, NEW)


def generate(eng: Any, path: Path, ps: list[list[int]], ref: list[list[int]],
             one_at_a_time: bool = False) -> list[dict]:
    """HF's greedy tokens, and their log-probabilities within LOGPROB_TOL of HF's (the tokens alone would
    not notice a slightly wrong state in a tiny random model); ``one_at_a_time``: each prompt alone, the
    engine checked after each."""
    if one_at_a_time:
        outs = []
        for p in ps:
            (o,) = eng.generate(input_ids=[p], sampling_params=GREEDY, return_logprob=True)
            eng.check_integrity()
            outs.append(o)
    else:
        outs = eng.generate(input_ids=ps, sampling_params=GREEDY, return_logprob=True)
    assert ids_of(outs) == ref
    got = [[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
    want = hf_output_logprobs(path, ps, ref)
    worst = max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert worst < LOGPROB_TOL, worst
    return outs
