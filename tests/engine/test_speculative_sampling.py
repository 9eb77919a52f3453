"""Rejection sampling keeps the output distribution (temperature > 0 with speculation on).

On a small vocabulary with fixed seeds: the acceptance rule alone against known distributions,
and the whole engine (a tiny random Llama with 16 tokens, drafting from a periodic prompt)
against the exact joint distribution of its next tokens computed with HF transformers. Each time
a chi-square test must pass, and the same test must reject a plausible wrong rule (on a rejected
draft, resample from ``p`` instead of ``p`` without the draft), so the test can fail."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from scipy.stats import chisquare

import serving.speculative.worker as worker_mod
from harness.model_utils import tiny_model
from serving.engine import Engine
from serving.speculative.cost import StepCost
from serving.speculative.verify import accept_sampled

VOCAB = 16
P_OK = 1e-3  # a correct rule passes at this level (fixed seeds: the same statistic every run)
P_WRONG = 1e-9  # the wrong rule must be rejected far below it


def wrong_rule(drafts, probs, generator):
    """Resamples from the full ``p`` after a rejection: P(draft) becomes p + (1 - p) p."""
    out = []
    for j, d in enumerate(drafts):
        p = probs[j]
        if bool(torch.rand((), generator=generator) < p[d]):
            out.append(d)
            continue
        out.append(int(torch.multinomial(p, 1, generator=generator).item()))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator).item()))
    return out


def chi2_p(observed: dict, expected: dict[tuple, float], n: int) -> float:
    """Chi-square p-value of ``observed`` counts against ``expected`` probabilities; cells expecting
    fewer than 5 are pooled into one."""
    obs, exp, rest_o, rest_e = [], [], 0, 0.0
    for cell, prob in expected.items():
        if prob * n >= 5:
            obs.append(observed.get(cell, 0))
            exp.append(prob * n)
        else:
            rest_o += observed.get(cell, 0)
            rest_e += prob * n
    rest_o += sum(c for cell, c in observed.items() if cell not in expected)
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    elif rest_o:
        return 0.0  # outcomes that cannot happen
    total = sum(exp)
    exp = [e * sum(obs) / total for e in exp]
    return float(chisquare(obs, exp).pvalue)


def rule_samples(rule, n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    p0 = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])
    p1 = torch.tensor([0.1, 0.1, 0.5, 0.2, 0.1])
    p2 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    probs = torch.stack([p0, p1, p2])
    counts: dict = {}
    for _ in range(n):
        toks = rule([1, 2], probs, g)  # drafts 1 then 2: p0(1) = 0.25, p1(2) = 0.5
        cell = tuple(toks[:2]) if toks[0] == 1 else (toks[0],)
        counts[cell] = counts.get(cell, 0) + 1
    # exact: the first token from p0; after the draft 1, the second from p1
    want = {(t,): float(p0[t]) for t in range(5) if t != 1}
    want.update({(1, t): float(p0[1] * p1[t]) for t in range(5)})
    return counts, want


def test_acceptance_rule_keeps_the_distribution():
    n = 20000
    counts, want = rule_samples(accept_sampled, n)
    assert chi2_p(counts, want, n) > P_OK
    counts, want = rule_samples(wrong_rule, n)
    assert chi2_p(counts, want, n) < P_WRONG


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("vocab16"), vocab_size=VOCAB, eos_token_id=VOCAB - 1)


SAMPLING = {"temperature": 1.5, "top_k": 6, "max_new_tokens": 4, "ignore_eos": True}
PROMPT_LEN = 38


class Exact:
    """The model's sampling distributions (SAMPLING's temperature and top-k) from HF transformers."""

    def __init__(self, path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def dist(self, seqs: list[list[int]]) -> torch.Tensor:
        with torch.inference_mode():
            logits = self.model(torch.tensor(seqs)).logits[:, -1].float() / SAMPLING["temperature"]
        kth = torch.topk(logits, SAMPLING["top_k"], dim=-1).values[:, -1:]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)

    def pick_prompt(self) -> list[int]:
        """A periodic prompt whose drafts are neither always nor never accepted (the wrong rule
        shows most there): the likeliest next token continues the pattern, and the draft after it
        has a probability near 1/2."""
        rng = random.Random(0)
        pats = [[rng.randrange(VOCAB - 1) for _ in range(rng.choice([3, 4, 6]))] for _ in range(300)]
        cands = [(pat * PROMPT_LEN)[:PROMPT_LEN] for pat in pats]
        nxt = [(pat * 2 * PROMPT_LEN)[PROMPT_LEN: PROMPT_LEN + 2] for pat in pats]
        p1 = self.dist(cands)
        p2 = self.dist([c + [d1] for c, (d1, _) in zip(cands, nxt, strict=True)])
        score = [float(p1[i, d1] * p2[i, d2] * (1 - p2[i, d2])) for i, (d1, d2) in enumerate(nxt)]
        return cands[max(range(len(cands)), key=score.__getitem__)]

    def joint(self, prompt: list[int]) -> dict[tuple, float]:
        """P(t1, t2, t3) after ``prompt``."""
        p1 = self.dist([prompt])[0]
        p2 = self.dist([prompt + [a] for a in range(VOCAB)])
        pairs = list(itertools.product(range(VOCAB), repeat=2))
        p3 = self.dist([prompt + list(ab) for ab in pairs])
        return {(a, b, c): float(p1[a] * p2[a, b] * p3[i, c]) for i, (a, b) in enumerate(pairs) for c in range(VOCAB)
                if p1[a] * p2[a, b] * p3[i, c] > 0}


def engine_samples(path, prompt: list[int], n: int) -> tuple[dict, int]:
    eng = Engine(model_path=str(path), page_size=4, max_total_tokens=8192, max_running_requests=64,
                 speculative_algorithm="NGRAM")
    spec = eng.core.speculative
    spec.cost = StepCost(0.01, adaptive=False)  # draft whenever a match allows
    counts: dict = {}
    for start in range(0, n, 256):
        outs = eng.generate(input_ids=[prompt] * 256, sampling_params=[{**SAMPLING, "seed": start + i}
                                                                      for i in range(256)])
        for o in outs:
            cell = tuple(o["output_ids"][:3])
            counts[cell] = counts.get(cell, 0) + 1
        eng.flush_cache()  # each batch drafts from its prompt, not from earlier samples
    eng.check_integrity()
    drafted = spec.stats.draft_tokens
    eng.shutdown()
    return counts, drafted


def test_engine_sampling_distribution_with_speculation(small_vocab, monkeypatch):
    n = 2048
    exact = Exact(small_vocab)
    prompt = exact.pick_prompt()
    want = exact.joint(prompt)
    counts, drafted = engine_samples(small_vocab, prompt, n)
    assert drafted >= n  # most requests verified drafts (up to 2 each)
    assert chi2_p(counts, want, n) > P_OK
    monkeypatch.setattr(worker_mod, "accept_sampled", wrong_rule)
    counts, _ = engine_samples(small_vocab, prompt, n)
    assert chi2_p(counts, want, n) < P_WRONG
