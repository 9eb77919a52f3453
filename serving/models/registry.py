"""Model classes by HF ``architectures`` name."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

_MODELS: dict[str, type[nn.Module]] = {}


def register_model(*names: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: ``@register_model("LlamaForCausalLM", "MistralForCausalLM")``."""

    def deco(cls: type[nn.Module]) -> type[nn.Module]:
        for name in names:
            if name in _MODELS and _MODELS[name] is not cls:
                raise ValueError(f"architecture {name!r} registered twice")
            _MODELS[name] = cls
        return cls

    return deco


def supported_architectures() -> list[str]:
    """Names that ``get_model_class`` accepts."""
    return sorted(_MODELS)


def get_model_class(architectures: Sequence[str]) -> type[nn.Module]:
    """The class of the first supported name in ``architectures`` (config.json's list)."""
    for name in architectures:
        if name in _MODELS:
            return _MODELS[name]
    raise ValueError(
        f"unsupported model architectures {list(architectures)}; supported: {supported_architectures()}"
    )
