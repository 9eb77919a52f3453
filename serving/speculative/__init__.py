"""Speculative decoding: drafts proposed from the cache, verified by the model in one pass.

- :mod:`serving.speculative.ngram_index`: the HiRadixTree as the n-gram source (positions of
  short token runs in the tree's nodes, fed by the tree's events, bounded);
- :mod:`serving.speculative.history`: the same over one request's own prompt and output;
- :mod:`serving.speculative.drafter`: a request's drafts (longest match, ranked, grammar-filtered);
- :mod:`serving.speculative.verify`: greedy acceptance and rejection sampling;
- :mod:`serving.speculative.policy`: how many drafts a request gets (auto-off when they miss);
- :mod:`serving.speculative.worker`: the scheduler's one hook (drafts in, logits to accept).

Torch-free at import (the config modules import :data:`ALGORITHMS`).
"""

from __future__ import annotations

ALGORITHMS = ("NGRAM",)  # serving.config.SPECULATIVE_ALGORITHMS
