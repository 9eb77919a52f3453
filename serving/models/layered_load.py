"""Loading a quantized model a decoder layer at a time, so the device never holds the whole model in
its floating dtype: ``--quantization fp8`` of a 70B (140 GB in bf16) on one 141 GB H200.

The model is built on the meta device (serving/models/loader.py). Before anything is allocated,
:func:`check_fits` estimates the bytes the loaded model keeps (each projection at its quantization
method's size, the rest in the model's dtype) and compares them with what the device has free:
a model that does not fit is one :class:`WeightsDoNotFit` line (bytes needed, bytes free, the flags
that change it). Then the parameters are taken in the model's order, grouped into runs: each decoder
layer's (``...layers.N....``) and the runs between them (the embedding; the final norm and LM head).
A group is allocated on the device, filled (seeded random values in the model's parameter order for
``dummy``: the same values as loading the whole model; a checkpoint's tensors of that layer for real
weights) and, for a layer, its projections are quantized at once, which frees their floating copies.
Peak device memory: the quantized layers so far, the float parameters outside the layers, and one
layer in its floating dtype.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from serving.models.quant.apply import finish, prepare, quantize_modules, quantized_weights

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class WeightsDoNotFit(ValueError):
    """The model's weights (as they will be kept) need more device memory than is free."""


def layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return None if m is None else int(m.group(1))


def groups(model: nn.Module) -> list[tuple[int | None, list[str]]]:
    """Consecutive runs of parameter names in the model's order, each with its layer (None: outside)."""
    out: list[tuple[int | None, list[str]]] = []
    for name, _ in model.named_parameters():
        layer = layer_of(name)
        if not out or out[-1][0] != layer:
            out.append((layer, []))
        out[-1][1].append(name)
    return out


def kept_bytes(model: nn.Module, method: Any, device: torch.device) -> int:
    """The bytes the loaded model keeps: what ``--quantization`` replaces on ``device`` (projections,
    CPU experts: serving/models/quant/apply.py ``quantized_weights``) at ``method``'s size, every other
    parameter in its dtype."""
    quantized = quantized_weights(model, device)
    total = sum(n * method.weight_bytes(out_f, in_f) for n, out_f, in_f in quantized.values())
    for name, p in model.named_parameters():
        if name not in quantized:
            total += p.numel() * p.element_size()
    return total


def free_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes free on ``device``, what they are)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, f"{device} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"
    from hicache import sizing

    mem = sizing.HostMemory.probe()
    return mem.available, f"the host has {mem.available / 2**30:.1f} GiB available"


def check_fits(model: nn.Module, method: Any, quantization: str, device: torch.device) -> None:
    need = kept_bytes(model, method, device)
    free, what = free_bytes(device)
    if need > free:
        raise WeightsDoNotFit(
            f"the model's weights need {need / 2**30:.1f} GiB with --quantization {quantization} and {what}: "
            "use a stronger --quantization, a larger --tp-size, or a device with more memory")


def _materialize(model: nn.Module, names: Iterable[str], device: torch.device) -> list[torch.Tensor]:
    modules = dict(model.named_modules())
    out = []
    for name in names:
        owner, _, attr = name.rpartition(".")
        mod = modules[owner]
        old = mod._parameters[attr]
        new = torch.empty_strided(old.size(), old.stride(), dtype=old.dtype, device=device)
        mod._parameters[attr] = nn.Parameter(new, requires_grad=False)
        out.append(mod._parameters[attr])
    return out


def load_layered(model: nn.Module, device: torch.device, quantization: str,
                 fill_dummy: Callable[[list[tuple[str, torch.Tensor]]], None] | None,
                 weights: Callable[[int | None], Iterable[tuple[str, Any]]] | None,
                 prequantized: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
    """Allocate, fill and quantize ``model`` (on the meta device) group by group (see the module
    doc). ``fill_dummy(params)``: fill these parameters (dummy weights, one generator for the whole
    model); else ``weights(layer)``: the checkpoint's tensors of that layer (None: outside the
    layers), handed to ``model.load_weights``. Raises WeightsDoNotFit before allocating anything."""
    method = prepare(model, quantization, device)
    check_fits(model, method, quantization, device)
    for name, buf in list(model.named_buffers()):
        owner, _, attr = name.rpartition(".")
        dict(model.named_modules())[owner]._buffers[attr] = torch.empty_like(buf, device=device)
    layers = dict(enumerate(getattr(model.model, "layers", []))) if hasattr(model, "model") else {}
    loaded: set[str] = set()
    plan = groups(model)
    if fill_dummy is None:  # real weights: everything outside the layers first (their names are the family's)
        _materialize(model, [n for layer, names in plan if layer is None for n in names], device)
        loaded |= model.load_weights(weights(None))
    for layer, names in plan:
        if fill_dummy is not None:
            params = _materialize(model, names, device)
            fill_dummy(list(zip(names, params, strict=True)))
        elif layer is not None:
            _materialize(model, names, device)
            loaded |= model.load_weights(weights(layer))
        if layer is not None and layer in layers:
            quantize_modules(layers[layer], method, f"model.layers.{layer}", prequantized)
    if fill_dummy is None:
        missing = {n for _, names in plan for n in names} - loaded
        if missing:
            raise ValueError(f"the checkpoint lacks weights: {sorted(missing)[:8]}")
    finish(model, method, quantization, bool(prequantized))
