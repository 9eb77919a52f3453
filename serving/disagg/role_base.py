"""A server's PD role: the scheduler's hooks for prefill-only and decode-only serving
(serving/disagg/role.py builds one by mode; prefill.py and decode.py are the two roles). A role is
built before the scheduler, from a :class:`RoleContext` (L1's pools, the model's KV tag and the
request cache, whose public methods are how it takes and releases pages), and handed to the
scheduler's constructor; it never sees the scheduler. The scheduler calls five hooks:

- :meth:`PDRole.on_add` a new request; True when the role took it (decode: it waits for
  its KV in the role, not in the scheduler's queue);
- :meth:`PDRole.on_finish` a request that just finished; True when the role keeps its pages
  (prefill: until they have been sent);
- :meth:`PDRole.step` once per scheduler step: move what is ready on; returns the requests whose
  prompt KV arrived, each with its first token (decode: the scheduler starts decoding them);
- :meth:`PDRole.abort`, :meth:`PDRole.held_pages` (integrity: L1 pages the role's requests
  hold outside the tree), :attr:`PDRole.busy` (the engine loop keeps stepping).

Concurrency contract (every role): all hooks run on the scheduler thread. Network I/O (the
control channel, the KV transport) runs on the role's own threads, which touch only the
messages and futures handed to them; their results come back through futures polled in
:meth:`step` and the control server's inbox. A request's pages are never freed while a
transfer may still write into (decode) or read from (prefill) them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.tiers.device import DeviceKVPool
    from hicache.tiers.state_pool import DeviceStatePool
    from serving.cache.req_cache import ReqCache
    from serving.process_config import EngineProcessConfig
    from serving.structs.request import Req


@dataclass(frozen=True)
class RoleContext:
    """What a role is built from: L1's KV pool and state pool (registered with the transport),
    the weights' KV tag both peers must agree on (``EngineCore.kv_model_tag``) and the request
    cache the role takes, hands over and releases pages through."""

    pool: DeviceKVPool
    state_pool: DeviceStatePool | None
    kv_model_tag: str
    cache: ReqCache


class PDRole:
    mode = "null"

    def _open_transport(self, server: EngineProcessConfig, ctx: RoleContext) -> None:
        """What both roles share: the request cache, the pool's geometry and the transport with L1 registered."""
        from serving.disagg.protocol import KVGeometry, StateGeometry
        from serving.disagg.transport import make_transport
        from serving.disagg.transport_base import TransportConfig

        self.cache = ctx.cache
        pool = ctx.pool
        state = ctx.state_pool
        if state is not None and server.disaggregation_transfer_backend == "cuda_ipc":
            raise ValueError("--disaggregation-transfer-backend cuda_ipc moves one buffer (L1's KV); a model with "
                             "linear-attention / Mamba layers also sends its state: use mooncake or nixl")
        if pool.windows is not None and server.disaggregation_transfer_backend == "cuda_ipc":
            raise ValueError("--disaggregation-transfer-backend cuda_ipc moves one buffer (L1's KV); with the hybrid "
                             "SWA L1 (--enable-hybrid-swa-memory) the sliding layers' window pool travels too: use "
                             "mooncake or nixl, or start without --enable-hybrid-swa-memory")
        self.timeout_s = server.disaggregation_bootstrap_timeout_s
        self.geometry = KVGeometry.of_pool(pool, ctx.kv_model_tag)
        self.page_size = pool.page_size
        self.transport = make_transport(server.disaggregation_transfer_backend,
                                        TransportConfig(host=server.disaggregation_transfer_host))
        self.transport.register_tensor(pool.kv_buffer)
        # a hybrid SWA L1: the sliding layers' window pool travels too (the prompt's last window)
        self.window_geometry = KVGeometry.of_windows(pool, ctx.kv_model_tag)
        if pool.win_buffer is not None:
            self.transport.register_tensor(pool.win_buffer)
        # a model with recurrent-state layers: its L1 state pool travels too (a request's working slot)
        self.state_geometry = StateGeometry.of_pool(state) if state is not None else None
        if state is not None:
            for t in state.slots.tensors():
                self.transport.register_tensor(t)

    def on_add(self, req: Req) -> bool:
        return False

    def on_finish(self, req: Req) -> bool:
        return False

    def step(self) -> list[tuple[Req, int]]:
        return []

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
