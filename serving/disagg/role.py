"""Which PD role a server takes: ``ROLES[mode]`` builds the role of ``--disaggregation-mode``
(``null``: none, the scheduler runs colocated). The hooks a role offers and their concurrency
contract: serving/disagg/role_base.py (PDRole).
"""

from __future__ import annotations

import importlib
from typing import Any

from serving.disagg.role_base import PDRole

# mode -> "module:class" (imported on use: a colocated server never loads a transport)
ROLES: dict[str, str] = {"prefill": "serving.disagg.prefill:PrefillRole", "decode": "serving.disagg.decode:DecodeRole"}


def make_role(server: Any, core: Any) -> PDRole | None:
    """The role of ``server.disaggregation_mode`` for ``core`` (None for ``null``), attached
    to its scheduler."""
    mode = server.disaggregation_mode
    if mode == "null":
        return None
    if mode not in ROLES:
        raise ValueError(f"unknown disaggregation_mode {mode!r}; choose from null, {', '.join(ROLES)}")
    module, name = ROLES[mode].split(":")
    role = getattr(importlib.import_module(module), name)(server, core)
    core.scheduler.attach_role(role)
    return role
