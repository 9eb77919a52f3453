"""Build a registered model from an HF folder: real safetensors weights, or dummy random ones."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

import serving.models  # noqa: F401 - registers the model classes
from serving.models.arch_config import ModelArchConfig
from serving.models.fp8_checkpoint import dequantizing
from serving.models.layered_load import layer_of, load_layered
from serving.models.quant import quantize_model
from serving.models.quant.auto import resolve_quantization
from serving.models.registry import get_model_class
from serving.parallel.group import TPGroup

log = logging.getLogger(__name__)
DUMMY_SEED = 0
DUMMY_STD = 0.02


def _iter_safetensors(model_path: Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) pairs: the model reads only its tensor-parallel shard of each. fp8
    weights come dequantized (whole tensors; serving.models.fp8_checkpoint)."""
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    with ExitStack() as stack:
        tensors: dict[str, Any] = {}
        for f in files:
            st = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for name in st.keys():  # noqa: SIM118 - safe_open is not a Mapping
                tensors[name] = st
        yield from dequantizing(model_path, tensors)


def _load_real(model: nn.Module, model_path: Path) -> None:
    loaded = model.load_weights(_iter_safetensors(model_path))
    missing = set(dict(model.named_parameters())) - loaded
    if missing:
        raise ValueError(f"checkpoint {model_path} lacks weights: {sorted(missing)[:8]}")


class DummyFill:
    """Seeded random weights (norms scaling by 1) so outputs are finite; reads no files. One
    generator for the whole model: filling the parameters in the model's order, whole or a group at
    a time (serving/models/layered_load.py), gives the same values."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.gen = torch.Generator(device=device).manual_seed(DUMMY_SEED)
        self.norm_weight = getattr(model, "dummy_norm_weight", 1.0)  # Gemma's norms scale by 1 + w: 0 there

    def __call__(self, params: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, p in params:
                if name.endswith("norm.weight"):
                    p.fill_(self.norm_weight)
                else:
                    p.normal_(0.0, DUMMY_STD, generator=self.gen)


def _load_dummy(model: nn.Module, model_path: Path) -> None:
    params = list(model.named_parameters())
    DummyFill(model, params[0][1].device)(params)


LOAD_FORMATS: dict[str, Callable[[nn.Module, Path], None]] = {
    "auto": _load_real,
    "safetensors": _load_real,
    "dummy": _load_dummy,
}


def load_model(
    model_path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_format: str = "auto",
    overrides: Mapping[str, Any] | None = None,
    tp: TPGroup | None = None,
    quantization: str = "none",
) -> tuple[nn.Module, ModelArchConfig]:
    """Load ``model_path`` (an HF folder with config.json) into an eval-mode model.

    ``overrides`` replace config.json keys (e.g. ``{"num_hidden_layers": 2}``) before parsing.
    ``load_format="dummy"`` needs only config.json: parameters are allocated directly on
    ``device`` (built on the meta device first, so nothing big is made on the CPU) and
    filled with seeded random values. ``tp``: build and load only this tensor-parallel
    rank's shard (serving.parallel). ``quantization``: a serving.models.quant method applied to the
    loaded (sharded) weights (``auto``: serving.models.quant.auto picks one for the device; the
    model's ``quantization`` says which); QuantizationError names what cannot run. Returns
    ``(model, config)``.
    """
    quantization = resolve_quantization(quantization, device, model_path)
    fill = LOAD_FORMATS.get(load_format)
    if fill is None:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {sorted(LOAD_FORMATS)}")
    path = Path(model_path)
    cfg = ModelArchConfig.from_pretrained(path, overrides)
    cls = get_model_class(cfg.architectures)
    with torch.device("meta"):
        model = cls(cfg, tp).to(dtype) if tp is not None else cls(cfg).to(dtype)
    model.eval().requires_grad_(False)
    pre = _gguf_int4(path, cfg, quantization, load_format, tp)
    if quantization != "none":  # a layer at a time: never the whole model in its floating dtype
        dev = torch.device(device)
        if load_format == "dummy":
            load_layered(model, dev, quantization, DummyFill(model, dev), None, pre)
        else:
            with ExitStack() as stack:
                by_layer = _checkpoint_by_layer(path, stack)
                load_layered(model, dev, quantization, None,
                             lambda layer: dequantizing(path, by_layer.get(layer, {})), pre)
        return model, cfg
    model = _empty_on(model, torch.device(device))
    fill(model, path)
    quantize_model(model, quantization, device, pre)
    return model, cfg


def _checkpoint_by_layer(model_path: Path, stack: ExitStack) -> dict[int | None, dict[str, Any]]:
    """The checkpoint's tensor names (-> their open file) by decoder layer (None: outside the layers)."""
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    out: dict[int | None, dict[str, Any]] = {}
    for f in files:
        st = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
        for name in st.keys():  # noqa: SIM118 - safe_open is not a Mapping
            out.setdefault(layer_of(name), {})[name] = st
    return out


def _empty_on(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to_empty(device=device)``: each meta tensor replaced by an uninitialised one of its
    size, strides and dtype on ``device``, without the meta ``empty_like`` (its first call sets up
    torch's Python reference kernels, ~1.3 s of every engine start)."""
    return model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))


def _gguf_int4(path: Path, cfg: ModelArchConfig, quantization: str, load_format: str,
               tp: TPGroup | None) -> dict[str, dict[str, torch.Tensor]] | None:
    """int4 from a converted GGUF whose projections are Q4_1: the file's blocks, packed as they are."""
    if quantization != "int4" or load_format == "dummy" or (tp is not None and tp.is_parallel):
        return None
    from serving.models.quant.gguf_q4 import gguf_source, int4_groups
    from serving.models.quant.int4 import Int4W4A8

    gguf = gguf_source(path)
    try:
        groups = None if gguf is None else int4_groups(gguf, cfg.num_attention_heads, cfg.num_key_value_heads)
    except ValueError as e:  # the converted weights hold the same codes: quantize those instead
        log.warning("int4: %s; quantizing the converted weights instead", e)
        return None
    if groups is None:
        return None
    log.info("int4: the Q4_1 blocks of %s, packed as they are", gguf.name)
    return {name: Int4W4A8.pack(*blocks) for name, blocks in groups.items()}
