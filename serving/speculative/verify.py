"""Which drafted tokens a verification pass accepts.

A request with drafts ``d_1 .. d_k`` runs ``[last, d_1, .., d_k]`` as new tokens in one forward
pass; row ``j`` of its logits (``j = 0 .. k``) is the next-token distribution after ``last, d_1 ..
d_j``, exactly what plain decoding would compute there if it had produced ``d_1 .. d_j``. The rows
are penalized with that history and masked by the grammar in that state, like the sampler's.

- Greedy: ``t_j = argmax(row j)``; the drafts are accepted while ``d_{j+1} == t_j``, then ``t_m``
  (the first disagreement, or the row after the last draft) follows as the bonus token: exactly
  the tokens greedy decoding gives, ``m + 1`` of them from one pass.
- Sampled (temperature > 0): standard speculative rejection sampling (Leviathan et al. 2023, Chen
  et al. 2023). The n-gram drafter is deterministic, so its proposal ``q_j`` is one-hot at
  ``d_{j+1}``: accept ``d_{j+1}`` with probability ``min(1, p_j(d) / q_j(d)) = p_j(d)``; on
  rejection sample from ``max(0, p_j - q_j)`` normalized, i.e. ``p_j`` without ``d``, and stop; when
  every draft was accepted, sample the bonus from ``p_k``. Each output token then has exactly the
  distribution ``p`` plain sampling gives (tests/engine/test_speculative_sampling.py checks it on a small
  vocabulary). ``p`` is the sampler's (serving.runner.sampler.Sampler.probs: temperature, top-k/p, min-p).
  A seeded request draws from its own generator: the same tokens every run, though not the same
  tokens as without speculation (the draws differ), as in SGLang and vLLM.
"""

from __future__ import annotations

import torch


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens greedy decoding appends: the drafts that match ``targets`` (row ``j``'s argmax),
    then the target after them. ``len(targets) == len(drafts) + 1``."""
    m = 0
    while m < len(drafts) and drafts[m] == targets[m]:
        m += 1
    return drafts[:m] + [targets[m]]


def accept_sampled(drafts: list[int], probs: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """Rejection sampling of deterministic drafts against ``probs`` (``[k + 1, vocab]``, row ``j``
    the target distribution after ``j`` drafts): the tokens to append (see the module doc)."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        p = probs[j]
        u = torch.rand((), generator=generator, device=p.device)
        pd = p[d]
        if bool(u < pd):
            out.append(d)
            continue
        residual = p.clone()
        residual[d] = 0.0
        total = residual.sum()
        if not bool(total > 0):  # p is one-hot at d (u < p(d) = 1 always held): cannot happen
            out.append(d)
            continue
        out.append(int(torch.multinomial(residual / total, 1, generator=generator).item()))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator).item()))
    return out
