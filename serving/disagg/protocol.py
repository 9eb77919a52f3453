"""Typed messages between a prefill and a decode server, and the KV geometry both must share.

The handshake (SGLang's shape, one bootstrap room per request):

1. the router sends the same request to a prefill and a decode server with the same
   ``bootstrap_room`` and the prefill server's ``bootstrap_host``/``bootstrap_port``;
2. the decode server takes L1 pages for the prompt (reusing the pages of a prefix its radix
   cache holds) and PUTs a :class:`DecodeTarget` to the prefill server's bootstrap port:
   its transport endpoint, its pool geometry, the pages to fill and where to report;
3. the prefill server computes the prompt (through its own HiCache), writes the KV of the
   pages the decode server does not hold straight into them with the transport (and, for a
   model with recurrent-state layers, its state after the prompt into the decode request's
   working state slot: :class:`StateGeometry`; for a hybrid SWA L1, the sliding layers' KV of the
   prompt's last window into the decode side's window pages: ``DecodeTarget.window``), then POSTs
   a :class:`KVDone` (the first token, and the logprobs only the prefill side could compute:
   serving/disagg/logprob_handoff.py) to the decode server, which decodes from there.

Both messages travel as JSON; ``from_dict`` validates types so a bad peer gets a 400.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from serving.disagg.logprob_handoff import check_wire

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def prompt_digest(ids: list[int]) -> str:
    """Both sides must have tokenized the same prompt: a hash of its token ids."""
    return xxhash.xxh3_64_hexdigest(b",".join(str(t).encode() for t in ids))


@dataclass(frozen=True)
class KVGeometry:
    """Where page ``p`` of layer ``l`` (K: kv=0, V: kv=1) lives in a DeviceKVPool's one buffer
    ``[2, layers, pages, page_size, kv_heads, head_dim]``: ``base + ((kv*layers + l)*pages + p) * chunk``."""

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_pages: int
    base: int
    # what computed the KV: the weights' --quantization (its L3 tag) and the L1 round trip of a
    # lossy lower-tier encoding; KV of other weights is another model's KV, even with equal bytes
    model_tag: str = ""

    @classmethod
    def of_pool(cls, pool: Any, model_tag: str = "") -> KVGeometry:
        """The pool's ``kv_buffer`` (with a hybrid SWA L1: its full layers only; :meth:`of_windows`)."""
        lay = pool.layout
        return cls(len(getattr(pool, "full_layers", range(lay.num_layers))), pool.page_size, lay.num_kv_heads,
                   lay.head_dim, str(lay.dtype).removeprefix("torch."), pool.num_pages, pool.kv_buffer.data_ptr(),
                   model_tag)

    @classmethod
    def of_windows(cls, pool: Any, model_tag: str = "") -> KVGeometry | None:
        """A hybrid SWA L1's window buffer (its sliding layers, by window page); None without one."""
        if getattr(pool, "win_buffer", None) is None:
            return None
        lay = pool.layout
        return cls(len(pool.window_layers), pool.page_size, lay.num_kv_heads, lay.head_dim,
                   str(lay.dtype).removeprefix("torch."), pool.window_pages, pool.win_buffer.data_ptr(), model_tag)

    @property
    def chunk(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def mismatch(self, other: KVGeometry) -> str | None:
        """Why KV of ``self`` cannot be written into ``other`` (None: it can)."""
        for name in ("num_layers", "page_size", "num_kv_heads", "head_dim", "dtype", "model_tag"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} differs: {getattr(self, name)} here, {getattr(other, name)} on the peer"
        return None

    def addrs(self, pages: list[int]) -> np.ndarray:
        """Chunk addresses of ``pages``, ordered (kv, layer, page)."""
        p = np.asarray(pages, dtype=np.int64)
        if p.size and (p.min() < 0 or p.max() >= self.num_pages):
            raise ValueError(f"a page is outside the pool of {self.num_pages} pages")
        planes = np.arange(2 * self.num_layers, dtype=np.int64)[:, None] * self.num_pages
        return (self.base + (planes + p[None, :]) * self.chunk).reshape(-1)


@dataclass(frozen=True)
class StateGeometry:
    """Where state slot ``s`` lives in a DeviceStatePool (a model with recurrent-state layers): per
    tensor of its StateLayout (layer by layer), ``bases[t] + s * row_bytes[t]``; ``layout`` names
    every tensor's shape and dtype (both sides must agree)."""

    bases: list[int]
    row_bytes: list[int]
    num_slots: int
    layout: str

    @classmethod
    def of_pool(cls, pool: Any) -> StateGeometry:
        tensors = pool.slots.tensors()
        layout = ";".join(f"{t.name}{list(t.shape)}:{str(t.dtype).removeprefix('torch.')}"
                          for layer in pool.layout.layers for t in layer)
        return cls([int(t.data_ptr()) for t in tensors], [int(t[0].numel() * t.element_size()) for t in tensors],
                   pool.num_slots, layout)

    def mismatch(self, other: StateGeometry | None) -> str | None:
        if other is None:
            return "the peer's model has no recurrent-state layers"
        if self.layout != other.layout:
            return f"state layouts differ: {self.layout} here, {other.layout} on the peer"
        return None

    def addrs(self, slot: int) -> tuple[list[int], list[int]]:
        """The chunk addresses and lengths of state slot ``slot``."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} is outside the pool of {self.num_slots} slots")
        return [b + slot * n for b, n in zip(self.bases, self.row_bytes, strict=True)], list(self.row_bytes)


def _typed(cls: type, d: Any) -> Any:
    if not isinstance(d, dict):
        raise ValueError(f"{cls.__name__}: expected a JSON object")
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(d) - set(names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    return d


@dataclass(frozen=True)
class DecodeTarget:
    room: int
    prompt_len: int
    prompt_digest: str
    endpoint: dict[str, Any]  # the decode side's transport endpoint
    geometry: KVGeometry
    pages: list[int]  # decode pages for prompt pages skip_pages .. ceil(prompt_len / page_size) - 1
    skip_pages: int  # leading prompt pages the decode side holds already (its radix cache)
    notify_url: str  # where the prefill side POSTs the KVDone
    state: StateGeometry | None = None  # a model with recurrent-state layers: the decode side's state pool
    state_slot: int = -1  # ... and the request's working slot there (the prefill side writes its state in)
    # a hybrid SWA L1 (--enable-hybrid-swa-memory): the decode side's window buffer, and the window pages of
    # prompt pages window_from .. ceil(prompt_len / page_size) - 1 (the prompt's last window, its own pages)
    window: KVGeometry | None = None
    window_pages: list[int] = field(default_factory=list)
    window_from: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> DecodeTarget:
        d = _typed(cls, d)
        try:
            geo = KVGeometry(**_typed(KVGeometry, d["geometry"]))
            state = None if d.get("state") is None else StateGeometry(**_typed(StateGeometry, d["state"]))
            if state is not None:
                state = StateGeometry([int(b) for b in state.bases], [int(n) for n in state.row_bytes],
                                      int(state.num_slots), str(state.layout))
            win = None if d.get("window") is None else KVGeometry(**_typed(KVGeometry, d["window"]))
            t = cls(int(d["room"]), int(d["prompt_len"]), str(d["prompt_digest"]), dict(d["endpoint"]), geo,
                    [int(p) for p in d["pages"]], int(d["skip_pages"]), str(d["notify_url"]), state,
                    int(d.get("state_slot", -1)), win, [int(p) for p in d.get("window_pages", [])],
                    int(d.get("window_from", 0)))
        except (KeyError, TypeError) as e:
            raise ValueError(f"DecodeTarget: {e}") from None
        if t.skip_pages < 0 or t.prompt_len <= 0 or t.window_from < 0:
            raise ValueError("DecodeTarget: skip_pages and window_from must be >= 0 and prompt_len > 0")
        return t


@dataclass(frozen=True)
class KVDone:
    room: int
    ok: bool
    first_token: int = -1
    error: str = ""
    status: int = 0  # HTTP status for the decode side's client when not ok
    cached_tokens: int = 0  # prompt tokens the prefill side served from its cache
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    pages: int = 0
    nbytes: int = 0
    transfer_s: float = 0.0
    logprobs: dict[str, Any] | None = None  # the first token's and the prompt's (logprob_handoff); None: not asked

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> KVDone:
        d = _typed(cls, d)
        try:
            return cls(**{**d, "room": int(d["room"]), "ok": bool(d["ok"]), "logprobs": check_wire(d.get("logprobs"))})
        except (KeyError, TypeError) as e:
            raise ValueError(f"KVDone: {e}") from None


__all__ = ["DecodeTarget", "KVDone", "KVGeometry", "StateGeometry", "prompt_digest"]
