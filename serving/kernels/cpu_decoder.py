"""A Llama-family model's decoder layers in one C++ call per forward on CPU (csrc/decoder.cpp).

At batch 1 SmolLM2's projections take a few milliseconds per token; the ~25 torch ops per layer
around them (norms, adds, views, SiLU, RoPE and the attention call) took as long again from
Python. :class:`FusedDecoder` hands the layers' weights to a C++ ``DecoderStack`` once, and each
forward is one call: residual adds, RMSNorm, the projections (the int4 / int8 / fp32 kernels the
model's layers would call), RoPE with K/V stored into the pages, attention over them, SiLU.

Used (``FusedDecoder.build`` returns it) where every piece has its C++ op: float32 on CPU, the C++
ops built (serving.kernels.cpu_ext, any variant: all give the same bits), ``--attention-backend
cpu`` with float32 KV and no lossy L1 round trip, one tensor-parallel rank, and every projection
fp32, int4 or int8, and a Llama-family block in every layer (full attention or a sliding window:
Mistral; attention sinks too, where a layer's spec says so and its attention module holds them as
``sinks``; a model class says so with ``fused_cpu_layers``: any other layer kind, norm or activation
would not be computed exactly). Elsewhere the model runs its modules as before. A token's result does not
depend on its batch (csrc/decoder.cpp), so prefill, decode and cache hits give the same KV; the
fused norm and SiLU sum in a fixed order of their own, so its bits differ from the module path's
(within float rounding), never from one call to the next or from one CPU variant to another.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from serving.kernels.cpu_ext import extension
from serving.structs.forward_batch import ForwardBatch

log = logging.getLogger(__name__)
KINDS = {"f32": 0, "int4": 1, "int8": 2, "q8_0": 3}


def _linear(mod: nn.Module) -> tuple[int, list[torch.Tensor], torch.Tensor | None] | str:
    """(kind, tensors, bias) of a projection module for the C++ stack, or why it cannot be one.
    A quantized projection (serving/models/quant/apply.py) offers ``quantized_parts()``: its
    method's name and tensors; a quantized row-parallel one wraps such a ``linear``."""
    from serving.parallel.layers import RowParallelLinear

    bias = getattr(mod, "bias", None)
    inner = getattr(mod, "linear", None)
    if hasattr(inner, "quantized_parts"):  # a quantized row-parallel projection
        if mod.tp.is_parallel:
            return "tensor parallelism"
        mod = inner
    if hasattr(mod, "quantized_parts"):
        name, q = mod.quantized_parts()
        if name in ("int4", "q8_0"):
            return KINDS[name], [q["packed"]], bias
        if name == "int8":
            return KINDS[name], [q["codes"], q["wsum"], q["scale"]], bias
        return f"--quantization {name}"
    if isinstance(mod, RowParallelLinear) and mod.tp.is_parallel:
        return "tensor parallelism"
    if isinstance(mod, (nn.Linear, RowParallelLinear)) and mod.weight.dtype == torch.float32:
        return KINDS["f32"], [mod.weight.detach()], None if bias is None else bias.detach()
    return f"a {type(mod).__name__} projection"


class FusedDecoder:
    """The C++ ``DecoderStack`` of one model and the per-forward metadata it reads. One user: the
    thread that runs the model's forward (the engine's scheduler thread)."""

    def __init__(self, stack, eps: float) -> None:  # noqa: ANN001 - the extension's class
        self.stack = stack
        self.eps = eps

    @staticmethod
    def build(model: nn.Module) -> tuple[FusedDecoder | None, str]:
        """(the fused decoder of ``model``, "") or (None, why not)."""
        if not getattr(model, "fused_cpu_layers", False):
            return None, f"{type(model).__name__} layers are not Llama blocks"
        ext = extension()
        if ext is None:
            return None, "no C++ CPU ops"
        if model.lm_head_weight.device.type != "cpu" or model.lm_head_weight.dtype != torch.float32:
            return None, "not float32 on CPU"
        specs = model.layer_stack.specs
        if any(spec.kind.value not in ("full_attention", "sliding_attention") for spec in specs):
            return None, "layers other than full or sliding-window attention"
        cfg, layers = model.config, model.model.layers
        attn0, mlp0 = layers[0].self_attn, layers[0].mlp
        try:
            stack = ext.DecoderStack(cfg.hidden_size, attn0.num_heads, attn0.num_kv_heads, attn0.head_dim, mlp0.inter,
                                     float(layers[0].input_layernorm.eps))
        except RuntimeError as e:
            return None, str(e).splitlines()[0]
        for layer in layers:
            parts = []
            for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                lin = _linear(mod)
                if isinstance(lin, str):
                    return None, lin
                parts.extend(lin)
            norms = layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()
            stack.add_layer(*norms, *parts)
        for i, (spec, layer) in enumerate(zip(specs, layers, strict=True)):
            if spec.window is not None:
                stack.set_window(i, spec.window)
            if spec.sinks:  # the layer's parameter itself (float32 [heads]): read at each forward, never copied
                sinks = getattr(layer.self_attn, "sinks", None)
                if not isinstance(sinks, torch.Tensor):
                    return None, f"layer {i} has attention sinks but its attention module holds no `sinks`"
                try:
                    stack.set_sinks(i, sinks.detach())
                except RuntimeError as e:
                    return None, str(e).splitlines()[0]
        return FusedDecoder(stack, float(model.model.norm.eps)), ""

    def forward(self, h: torch.Tensor, batch: ForwardBatch, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                cos: torch.Tensor, sin: torch.Tensor, scale: float) -> torch.Tensor:
        """Run every layer on the residual stream ``h [T, hidden]`` (updated in place); return the
        last layer's output, not yet added to ``h``."""
        return self.stack.forward(h, None, k_caches, v_caches, cos, sin, batch.positions, batch.out_cache_loc,
                                  batch.page_table, batch.page_size, batch.prefix_lens, batch.extend_lens, scale, 0,
                                  self.stack.num_layers())

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return extension().rmsnorm(x, weight, self.eps)


def usable(attn, kv_dtype: torch.dtype, batch: ForwardBatch) -> bool:  # noqa: ANN001 - an AttentionBackend
    """Whether this forward can take the fused path: the cpu attention backend without a lossy L1
    round trip, float32 KV, and no GPU-side layer waits."""
    return (getattr(attn, "name", "") == "cpu" and attn.kv_round_trip is None and kv_dtype == torch.float32
            and batch.layer_waits is None)
