"""A request's state inside the scheduler."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hicache import salt
from serving.structs.bootstrap import Bootstrap
from serving.structs.req_kv import ReqKV
from serving.structs.req_parts import GrammarSlot, LogprobSlot, SpecSlot
from serving.structs.sampling_params import SamplingParams


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    session_id: str | None = None
    # cache partition (hicache.salt): tags of the request's effective cache_salt (() = unsalted) and
    # its tenant (None: the default tenant), for per-tenant quotas and counters
    salt_tags: tuple[int, ...] = ()
    tenant: str | None = None
    output_ids: list[int] = field(default_factory=list)
    kv: ReqKV = field(default_factory=ReqKV)  # what the cache holds for it: written by serving/cache only
    pd: Bootstrap | None = None  # a PD request's prefill server and room
    # prompt lengths of its cache_control breakpoints: a model with recurrent-state layers keeps its state
    # there (serving/cache/request_states.py), where a later request with the same prefix resumes
    capture_at: tuple[int, ...] = ()
    finish_reason: dict[str, Any] | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_retractions: int = 0
    # the scheduler's optional parts' state for this request (serving/structs/req_parts.py names each owner)
    grammar: GrammarSlot | None = None  # structured output (None: unconstrained)
    logprob: LogprobSlot | None = None  # a request asking for logprobs (None: it does not)
    spec: SpecSlot | None = None  # once it decodes with speculation (None: it does not)
    # Overlap scheduling: row of the previous step's on-GPU token tensor that holds this
    # request's next token, not yet on the host (-1: none). While set, ``fill_ids`` ends with
    # the placeholder ``-1 - pending`` (substituted on the GPU when fed to the model) and
    # ``seq_len`` counts it; ``output_ids`` never holds it.
    pending: int = -1

    @property
    def fill_ids(self) -> list[int]:
        """The sequence as the KV cache keys it: with a cache salt its first ids are salted
        (hicache.salt); the model reads :meth:`model_ids`."""
        ids = self.input_ids + self.output_ids
        if self.pending >= 0:
            ids.append(-1 - self.pending)
        return salt.apply(ids, self.salt_tags) if self.salt_tags else ids

    def model_ids(self, lo: int, hi: int) -> list[int]:
        """Raw ids of positions ``lo .. hi - 1`` (placeholders included): what the model reads."""
        ids = self.input_ids + self.output_ids
        if self.pending >= 0:
            ids.append(-1 - self.pending)
        return ids[lo:hi]

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids) + (self.pending >= 0)

    @property
    def own_pages(self) -> int:
        """Pages held by this request and not (yet) by the tree."""
        return self.kv.own_pages

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.kv.kv_len < self.seq_len - 1
