"""Pieces the hybrid families share (serving/models/qwen3_5.py, nemotron_h.py): their norms and
activations, HF-named weight loading, and the base class with the layer stack, the state layout and
the last-token logits.

The hybrid families keep HF's parameter names as they are (no fused projections) and take the state
pool as the forward pass's fourth argument. Under tensor parallelism (``tp``) every module holds its
rank's shard: a module with a ``tp_source(leaf)`` method says which blocks of its HF tensors are its
rank's (the state layers, serving/parallel/state_shard.py; Qwen3.5's gated q_proj), the rest is cut
as Llama's (``ShardPlan.source_range``: q/k/v, gate/up, o/down, the vocab rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hicache.tiers.state_layout import StateLayout
from hicache.tiers.state_pool import DeviceStatePool
from serving.kernels.attention_base import AttentionBackend
from serving.models.arch_config import ModelArchConfig
from serving.models.layer_spec import LayerStack
from serving.models.state_scan import StatePlan
from serving.parallel.group import TPGroup
from serving.parallel.layers import parallel_logits
from serving.parallel.shard import ShardPlan
from serving.parallel.state_shard import Blocks, narrow_blocks
from serving.structs.forward_batch import ForwardBatch

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu2": lambda x: torch.square(F.relu(x)),
    "gelu": F.gelu,
}


def activation(name: str, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    fn = ACTIVATIONS.get(name)
    if fn is None:
        raise ValueError(f"unsupported {what} activation {name!r}; supported: {sorted(ACTIVATIONS)}")
    return fn


class OffsetRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: weights stored around zero, scale ``1 + w``, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm with a SiLU gate, normalized over groups of ``group_size`` (None: the whole row).

    ``norm_before_gate`` (Gated DeltaNet): ``w * norm(x) * silu(z)``; otherwise (Mamba2):
    ``w * norm(x * silu(z))``."""

    def __init__(self, size: int, eps: float, group_size: int | None = None, norm_before_gate: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.group_size = group_size or size
        self.norm_before_gate = norm_before_gate

    def _norm(self, xf: torch.Tensor) -> torch.Tensor:
        shape = xf.shape
        g = xf.view(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return g.view(shape)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.norm_before_gate:
            h = self.weight * self._norm(x.float()).to(dtype)
            return (h * F.silu(gate.float())).to(dtype)
        h = self._norm(x.float() * F.silu(gate.float()))
        return self.weight * h.to(dtype)


class HybridCausalLM(nn.Module):
    """What a hybrid family has in common: ``layer_stack``, ``state_layout``, HF-named loading and the
    last-token logits. Subclasses build ``self.layer_stack`` and ``self.mixers`` (per model layer, its
    token mixer module or None) and implement ``forward(batch, kv, attn, state)``: the new tokens of
    ``batch`` through the layers, ``[B, vocab]`` float32 last-token logits (then ``batch.logit_rows``);
    ``state`` is the L1 state pool (``batch.state_slots`` index it), set up by :meth:`begin_forward`."""

    layer_stack: LayerStack
    conv_kernel: int  # the state layers' short convolution width (their conv state keeps conv_kernel - 1 inputs)
    state_kind = "state"  # what the family's state layers are, for errors ("Mamba2", "Gated DeltaNet")
    # checkpoint name prefixes read as another (Nemotron-H's checkpoints say ``backbone.`` for ``model.``)
    prefix_aliases: dict[str, str] = {}

    def __init__(self, cfg: ModelArchConfig, tp: TPGroup | None, family: str) -> None:
        super().__init__()
        self.family = family
        self.config = cfg
        self.tp = tp or TPGroup()
        self.plan = ShardPlan.for_model(cfg, self.tp.rank, self.tp.size)  # the runner reads its kv heads
        self.logits_matmul = None  # no quantized LM head for these families yet
        self.lm_head = None if cfg.tie_word_embeddings else \
            nn.Linear(cfg.hidden_size, self.plan.vocab_per_rank, bias=False)

    def mixer(self, layer: int) -> nn.Module:
        raise NotImplementedError

    @property
    def embed(self) -> nn.Module:  # a VocabParallelEmbedding
        raise NotImplementedError

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def state_layout(self, dtype: torch.dtype) -> StateLayout:
        """Per state layer (in ``layer_stack.state_layers`` order) its conv and recurrent tensors;
        ``dtype`` is the conv state's (the recurrent state is float32)."""
        return StateLayout(tuple(self.mixer(i).state_tensors(dtype) for i in self.layer_stack.state_layers))

    def begin_forward(self, batch: ForwardBatch, attn: AttentionBackend,
                      state: DeviceStatePool | None) -> StatePlan | None:
        """A forward pass's start: the state layers' plan for ``batch`` (None without state layers;
        with them ``state`` is required) and the attention backend's per-batch set-up."""
        plan = None
        if self.layer_stack.state_layers:
            if state is None:
                raise ValueError(f"{self.family} has {self.state_kind} layers: its forward pass needs the state pool")
            plan = batch.state_plan or StatePlan.build(batch, self.conv_kernel)
        attn.init_forward(batch)
        return plan

    def last_logits(self, h: torch.Tensor, batch: ForwardBatch, norm: nn.Module) -> torch.Tensor:
        """``[B, vocab]`` float32 logits of each sequence's last new token (then ``batch.logit_rows``)."""
        last = batch.extend_start.to(torch.int64) + batch.extend_lens.to(torch.int64) - 1
        if batch.logit_rows is not None:
            last = torch.cat([last, batch.logit_rows])
        return parallel_logits(norm(h[last]), self.lm_head_weight, self.plan, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy HF-named tensors (or lazy safetensors slices) into the parameters of the same name;
        names this model has no parameter for (a tied ``lm_head``, MTP heads, a vision tower) are skipped.
        Under tensor parallelism each parameter takes its rank's part (:meth:`tp_source`)."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            for alias, prefix in self.prefix_aliases.items():
                if name.startswith(alias):
                    name = prefix + name.removeprefix(alias)
            param = params.get(name)
            if param is None:
                continue
            src = narrow_blocks(tensor, self.tp_source(name, modules))
            if src.shape[0] < param.shape[0] and src.shape[1:] == param.shape[1:] and name.endswith(
                    (".embed_tokens.weight", ".embeddings.weight", "lm_head.weight")):
                src = torch.cat([src, src.new_zeros(param.shape[0] - src.shape[0], *src.shape[1:])])  # vocab padding
            if tuple(src.shape) != tuple(param.shape):
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(src.shape)}, the model "
                                 f"{tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(src)
            loaded.add(name)
        return loaded

    def tp_source(self, name: str, modules: dict[str, nn.Module]) -> Blocks | None:
        """This rank's blocks of the HF tensor ``name`` (None: all of it): what the innermost module on
        its path with a ``tp_source`` answers, else ``ShardPlan.source_range`` by the tensor's module
        name (the state layers' own names are none of Llama's, so that holds them whole)."""
        if not self.tp.is_parallel:
            return None
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            owner = modules.get(".".join(parts[:i]))
            if owner is not None and owner is not self and hasattr(owner, "tp_source"):
                blocks = owner.tp_source(".".join(parts[i:]))
                if blocks is not None:
                    return blocks
                break
        piece = parts[-2] if len(parts) >= 2 else ""
        rng = self.plan.source_range(_PIECES.get(piece, piece), parts[-1])
        return None if rng is None else (rng[0], [rng[1:]])


_PIECES = {"embeddings": "embed_tokens"}  # Nemotron-H's name for the embedding
