"""HiCache serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serving.engine.offline import Engine

__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from serving.engine.offline import Engine

        return Engine
    raise AttributeError(name)
