"""A model as a stack of typed layers: what each layer's token mixer is, so the cache sees components,
not model names.

Kinds (``LayerKind``): full attention and sliding-window attention hold KV per token (the paged L1
pool; ``window`` and ``sinks`` say what a sliding layer reads); linear attention (Gated DeltaNet) and
Mamba2 hold a recurrent state per sequence (a state slot, hicache/tiers/state_layout.py); an ``mlp``
layer (Nemotron-H's ``-``) mixes no tokens and holds nothing. A model class exposes its
``layer_stack``; the model runner sizes L1 from it (KV pages for the KV layers only, state slots for
the state layers) and the cache keys each component by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class LayerKind(StrEnum):
    FULL = "full_attention"
    SLIDING = "sliding_attention"
    LINEAR = "linear_attention"  # Gated DeltaNet (Qwen3.5, Qwen3-Next)
    MAMBA = "mamba"  # Mamba2 (Nemotron-H, Falcon-H1, Granite-4)
    MLP = "mlp"  # no token mixer (Nemotron-H's MLP-only blocks)

    @property
    def has_kv(self) -> bool:
        return self in (LayerKind.FULL, LayerKind.SLIDING)

    @property
    def has_state(self) -> bool:
        return self in (LayerKind.LINEAR, LayerKind.MAMBA)


@dataclass(frozen=True)
class LayerSpec:
    """One layer's token mixer. ``window``: a sliding layer's query at position ``p`` reads the
    positions ``p - window + 1 .. p`` (HF's ``sliding_window``); ``sinks``: an attention layer (full or
    sliding) with learned attention sinks (GPT-OSS: a logit per query head in the softmax's denominator;
    the layer passes its ``[q_heads]`` float32 parameter as ``AttentionBackend.forward``'s ``sinks``)."""

    kind: LayerKind
    window: int | None = None
    sinks: bool = False

    def __post_init__(self) -> None:
        if (self.kind is LayerKind.SLIDING) != (self.window is not None):
            raise ValueError(f"a {self.kind} layer {'needs' if self.kind is LayerKind.SLIDING else 'has no'} window")
        if self.window is not None and self.window < 1:
            raise ValueError(f"sliding window {self.window} < 1")
        if self.sinks and not self.kind.has_kv:
            raise ValueError(f"a {self.kind} layer has no attention sinks")


@dataclass(frozen=True)
class LayerStack:
    """The model's layers in order, and the index maps the pools use."""

    specs: tuple[LayerSpec, ...]

    @staticmethod
    def all_full(num_layers: int) -> LayerStack:
        return LayerStack((LayerSpec(LayerKind.FULL),) * num_layers)

    @staticmethod
    def from_kinds(kinds: list[str] | tuple[str, ...], window: int | None = None, sinks: bool = False) -> LayerStack:
        """From HF's ``layer_types`` names (``full_attention`` / ``sliding_attention`` /
        ``linear_attention`` / ``mamba`` / ``mlp``); ``window`` for the sliding ones; ``sinks``: every
        attention layer has sinks (GPT-OSS)."""
        specs = []
        for name in kinds:
            kind = LayerKind(name)
            specs.append(LayerSpec(kind, window if kind is LayerKind.SLIDING else None, sinks and kind.has_kv))
        return LayerStack(tuple(specs))

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Model layer indices that hold KV, in order: KV pool layer ``j`` is model layer ``kv_layers[j]``."""
        return tuple(i for i, s in enumerate(self.specs) if s.kind.has_kv)

    @property
    def state_layers(self) -> tuple[int, ...]:
        """Model layer indices that hold a recurrent state: state layer ``j`` is ``state_layers[j]``."""
        return tuple(i for i, s in enumerate(self.specs) if s.kind.has_state)

    def kv_index(self, layer: int) -> int:
        return self.kv_layers.index(layer)

    def state_index(self, layer: int) -> int:
        return self.state_layers.index(layer)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per KV layer: its window (None: full attention)."""
        return tuple(self.specs[i].window for i in self.kv_layers)

    @property
    def sinks(self) -> tuple[bool, ...]:
        """Per KV layer: whether it has attention sinks."""
        return tuple(self.specs[i].sinks for i in self.kv_layers)

    @property
    def is_hybrid(self) -> bool:
        return any(s.kind is not LayerKind.FULL for s in self.specs)
