"""Swap a loaded model's projections for quantized ones (after loading, after TP sharding).

What is replaced is one list, :func:`quantized_weights`: every ``nn.Linear`` (qkv_proj, gate_up_proj;
not an untied lm_head) becomes a :class:`QuantLinear`, every ``RowParallelLinear`` (o_proj, down_proj) a
:class:`QuantRowParallelLinear` holding this rank's shard, and a module with ``quantize_experts``
(serving/models/moe.py's ``SparseMoE``) quantizes its experts itself; a module's ``unquantized`` names
children it reads as float weights (a mixture's router, MLA's ``kv_b_proj``, absorbed into decode) and
they stay as they are; the LM head's matmul is quantized too
(``model.logits_matmul``, with the method's ``head_method`` when it names one) while the embedding
lookup keeps the float table (SmolLM2 ties the two). Under tensor parallelism each rank quantizes
the shard it loaded, so scales are per shard: with per-output-channel (and per-group) scales that
is the same as quantizing the full weight and then splitting it, except row-split layers' channel
scales, which are taken over the rank's input columns only.
"""

from __future__ import annotations

import torch
from torch import nn

from serving.models.quant.base import QuantMethod, get_quant_method
from serving.parallel.group import TPGroup
from serving.parallel.layers import RowParallelLinear


class QuantLinear(nn.Module):
    """``y = method.matmul(x) + bias`` over quantized weight tensors (kept as plain attributes:
    some are opaque prepacked tensors that ``state_dict`` / ``.to()`` cannot handle)."""

    def __init__(self, method: QuantMethod, weight: torch.Tensor, bias: torch.Tensor | None,
                 q: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.method = method
        self.out_features, self.in_features = weight.shape
        self.q = method.quantize(weight.detach()) if q is None else q  # q: already quantized (a GGUF's blocks)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def quantized_parts(self) -> tuple[str, dict[str, torch.Tensor]]:
        """The method's name and the quantized tensors (what the C++ CPU decoder stack reads)."""
        return self.method.name, self.q

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.method.matmul(x.reshape(-1, self.in_features), self.q)
        return y.reshape(*lead, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.method.name}"


class QuantRowParallelLinear(nn.Module):
    """RowParallelLinear over a quantized shard: ``all_reduce(x_local @ W_local^T) + b``."""

    def __init__(self, method: QuantMethod, row: RowParallelLinear, q: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.tp: TPGroup = row.tp
        self.linear = QuantLinear(method, row.weight, None, q)
        self.bias = row.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear.matmul(x)
        if self.tp.is_parallel:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def quantized_weights(model: nn.Module, device: torch.device) -> dict[str, tuple[int, int, int]]:
    """What ``--quantization`` replaces on ``device`` (the one list: the fit check, the shape checks and
    :func:`quantize_modules` read it): parameter name -> (count, out, in) of the ``[out, in]`` weights it
    holds (1 for a projection, one per expert for a mixture's stacked experts). Not the LM head (its matmul
    is quantized apart), not a module's ``unquantized`` children (a mixture's router, MLA's ``kv_b_proj``),
    not experts the fused kernels run there. Shapes only: the model may still be on the meta device."""
    kept = {f"{name}.{c}" if name else c
            for name, mod in model.named_modules() for c in getattr(mod, "unquantized", ())}
    out: dict[str, tuple[int, int, int]] = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "expert_shapes"):
            if not mod.fused_on(device):
                for part, (out_f, in_f) in mod.expert_shapes().items():
                    out[f"{name}.{part}" if name else part] = (mod.num_experts, out_f, in_f)
        elif isinstance(mod, (nn.Linear, RowParallelLinear)) and not name.endswith("lm_head") and name not in kept:
            out[f"{name}.weight"] = (1, *mod.weight.shape)
    return out


def _check(method: QuantMethod, model: nn.Module, device: torch.device) -> None:
    """Every refusal before anything is changed: the device, then each weight's shape (shapes only:
    the model may still be on the meta device)."""
    method.check_device(device)
    for name, (n, out_f, in_f) in quantized_weights(model, device).items():
        owner, leaf = name.rsplit(".", 1)
        method.check_shape(owner if n == 1 else f"{owner}.experts.{leaf}", out_f, in_f)
    head = _head(method)
    head.check_device(device)
    head.check_shape("lm_head", *model.lm_head_weight.shape)


def _head(method: QuantMethod) -> QuantMethod:
    return method if method.head_method is None else get_quant_method(method.head_method)


def prepare(model: nn.Module, quantization: str, device: torch.device | str) -> QuantMethod:
    """The method of ``quantization`` after every check of :func:`_check` (QuantizationError)."""
    method = get_quant_method(quantization)
    _check(method, model, torch.device(device))
    return method


def quantize_modules(root: nn.Module, method: QuantMethod, prefix: str = "",
                     prequantized: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
    """Replace what :func:`quantized_weights` lists under ``root`` (named ``prefix`` in the model) with
    quantized projections; a mixture quantizes its experts itself. The LM head is left to :func:`finish`."""
    pre = prequantized or {}
    first = next(root.parameters(), None)
    if first is None:
        return
    modules = dict(root.named_modules())
    with torch.no_grad():
        for name in quantized_weights(root, first.device):
            owner = name.rpartition(".")[0]
            mod = modules[owner]
            if hasattr(mod, "quantize_experts"):  # "<mixture>.w13" / ".w2": its experts, the router kept
                mod.quantize_experts(method)
                continue
            parent_name, _, child = owner.rpartition(".")
            full = ".".join(p for p in (prefix, owner) if p)
            q = pre.get(full)
            replaced = QuantRowParallelLinear(method, mod, q) if isinstance(mod, RowParallelLinear) else \
                QuantLinear(method, mod.weight, mod.bias, q)
            setattr(modules[parent_name], child, replaced)


def finish(model: nn.Module, method: QuantMethod, quantization: str, prequantized: bool) -> None:
    """The LM head's quantized matmul and the model's quantization tags."""
    with torch.no_grad():
        model.logits_matmul = QuantLinear(_head(method), model.lm_head_weight, None).matmul
    model.quantization = quantization
    # what the L3 namespace and PD peers compare: the method's tag, where the codes came from, and whether
    # a mixture's experts are quantized too (KV computed with float experts is other KV)
    experts = any(getattr(m, "quant", None) is not None for m in model.modules() if hasattr(m, "quantize_experts"))
    model.quant_tag = (method.kv_tag or quantization) + (":gguf" if prequantized else "") + \
        (":experts" if experts else "")


def quantize_model(model: nn.Module, quantization: str, device: torch.device | str,
                   prequantized: dict[str, dict[str, torch.Tensor]] | None = None) -> nn.Module:
    """Quantize ``model``'s projections and LM head in place with ``quantization`` (a registered
    method name; ``none`` leaves it as it is). Raises QuantizationError naming what cannot run.
    ``prequantized``: {module name: the method's tensors} taken as they are (serving.models.quant.gguf_q4)."""
    if quantization == "none":
        model.quantization = model.quant_tag = "none"
        return model
    method = prepare(model, quantization, device)
    quantize_modules(model, method, "", prequantized)
    finish(model, method, quantization, bool(prequantized))
    return model
