"""Which PD role a server takes: ``ROLES[mode]`` builds the role of ``--disaggregation-mode``
(``null``: none, the scheduler runs colocated). The hooks a role offers and their concurrency
contract: serving/disagg/role_base.py (PDRole).
"""

from __future__ import annotations

import importlib

from serving.disagg.role_base import PDRole, RoleContext
from serving.process_config import EngineProcessConfig

# mode -> "module:class" (imported on use: a colocated server never loads a transport)
ROLES: dict[str, str] = {"prefill": "serving.disagg.prefill:PrefillRole", "decode": "serving.disagg.decode:DecodeRole"}


def make_role(server: EngineProcessConfig, ctx: RoleContext) -> PDRole | None:
    """The role of ``server.disaggregation_mode`` (None for ``null``), built from ``ctx``; the
    engine hands it to its scheduler's constructor."""
    mode = server.disaggregation_mode
    if mode == "null":
        return None
    if mode not in ROLES:
        raise ValueError(f"unknown disaggregation_mode {mode!r}; choose from null, {', '.join(ROLES)}")
    module, name = ROLES[mode].split(":")
    return getattr(importlib.import_module(module), name)(server, ctx)
