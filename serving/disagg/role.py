"""A server's PD role: the scheduler's hooks for prefill-only and decode-only serving.

Registry: ``ROLES[mode]`` builds the role of ``--disaggregation-mode`` (``null``: none, the
scheduler runs colocated). A role sees the scheduler through five hooks:

- :meth:`PDRole.on_add` a new request; True when the role took it (decode: it waits for
  its KV in the role, not in the scheduler's queue);
- :meth:`PDRole.on_finish` a request that just finished; True when the role keeps its pages
  (prefill: until they have been sent);
- :meth:`PDRole.step` once per scheduler step: move what is ready on;
- :meth:`PDRole.abort`, :meth:`PDRole.held_pages` (integrity: L1 pages the role's requests
  hold outside the tree), :attr:`PDRole.busy` (the engine loop keeps stepping).

Concurrency contract (every role): all hooks run on the scheduler thread. Network I/O (the
control channel, the KV transport) runs on the role's own threads, which touch only the
messages and futures handed to them; their results come back through futures polled in
:meth:`step` and the control server's inbox. A request's pages are never freed while a
transfer may still write into (decode) or read from (prefill) them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serving.request import Req
    from serving.scheduler import Scheduler


class PDRole:
    mode = "null"

    def _open_transport(self, server: Any, core: Any) -> None:
        """What both roles share: the pool's geometry and the transport with L1 registered."""
        from serving.disagg.protocol import KVGeometry
        from serving.disagg.transport import TransportConfig, make_transport

        pool = core.runner.pool
        self.timeout_s = server.disaggregation_bootstrap_timeout_s
        self.geometry = KVGeometry.of_pool(pool, core.kv_model_tag)
        self.page_size = pool.page_size
        self.transport = make_transport(server.disaggregation_transfer_backend,
                                        TransportConfig(host=server.disaggregation_transfer_host))
        self.transport.register_tensor(pool.kv_buffer)

    def attach(self, scheduler: Scheduler) -> None:
        self.sched = scheduler

    def on_add(self, req: Req) -> bool:
        return False

    def on_finish(self, req: Req) -> bool:
        return False

    def step(self) -> None:
        pass

    def abort(self, rid: str) -> Req | None:
        return None

    @property
    def busy(self) -> bool:
        return False

    def held_pages(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {"disaggregation_mode": self.mode}

    def close(self) -> None:
        pass


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
