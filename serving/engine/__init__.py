"""The engine process (``main``: its entry point, ``loop``: its step loop, ``config``: its own
frozen config) and the offline engine (``offline.Engine``, shaped like ``sgl.Engine``).

``Engine`` is imported lazily, so ``from serving.engine import Engine`` works while importing
``serving.engine.main`` (the HTTP process does, for the spawn target) pulls in no torch.
"""

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
