"""What a request asks of logprobs, as its API spells it (SGLang's ``logprob_start_len``,
``top_logprobs_num``, ``token_ids_logprob``): built by the HTTP side or the offline Engine, carried by
``ipc.GenerateReq``, checked against the prompt by the engine (serving/runner/logprobs.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LogprobOptions:
    start_len: int | None = None  # prompt logprobs from here (None / -1: none)
    top: int = 0
    token_ids: tuple[int, ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"start_len": self.start_len, "top": self.top,
                "token_ids": None if self.token_ids is None else list(self.token_ids)}

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> LogprobOptions:
        ids = d.get("token_ids")
        return cls(d.get("start_len"), d.get("top") or 0, None if ids is None else tuple(ids))
