"""The engine loop's housekeeping: what it does every turn besides steps and messages.

:class:`Housekeeping` closes sessions idle for longer than ``session_idle_timeout_s`` (about
once a second), ends the KV control's expired pin leases and sends its deferred answers (L3
lookups), beats the watchdog's heartbeat (serving.engine.heartbeat), and builds the engine's
stats (the ``Stats`` and ``CheckIntegrity`` answers). The loop that calls it: serving.engine.loop.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from serving import ipc as m
from serving.cache.kv_control import KVControl
from serving.engine.heartbeat import HeartbeatWriter
from serving.engine.requests import Outbox, RequestTable

if TYPE_CHECKING:
    from serving.engine.core import EngineCore

log = logging.getLogger("hicache.engine")
SESSION_SWEEP_S = 1.0


class Housekeeping:
    """Session sweep, KV-control turn, heartbeat and stats of the engine loop.

    Concurrency contract: the loop thread only (it owns the EngineCore, the KV control and the
    request table read here); no lock. It never waits: the sweep runs at most every
    ``SESSION_SWEEP_S``, an L3 lookup not done yet is answered by a later turn, and a beat is a
    write into the watchdog's shared array (read by the HTTP process)."""

    def __init__(self, core: EngineCore, control: KVControl, requests: RequestTable, out: Outbox,
                 idle_timeout: float, heartbeat: m.Heartbeat | None = None) -> None:
        self.core = core
        self.control = control
        self.requests = requests
        self.out = out
        self.idle_timeout = idle_timeout
        self.heartbeat = HeartbeatWriter(heartbeat)
        self._next_sweep = time.monotonic() + SESSION_SWEEP_S

    def beat(self, busy: bool, progressed: bool) -> None:
        self.heartbeat.beat(busy=busy, progressed=progressed, forward_passes=self.core.scheduler.stats.forward_passes)

    def sweep_sessions(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SESSION_SWEEP_S
        busy = self.requests.busy_sessions()
        for sid, idle_s in self.control.retention.idle_sessions(busy, self.idle_timeout): # kv_sessions.py
            if sid in self.core.sessions:
                log.info("session %s idle for %.0f s: closed", sid, idle_s)
                self.core.close_session(sid)
            self.control.retention.close_session(sid)

    def control_turn(self) -> None:
        """Leases that ended are released; deferred control answers (L3 lookups) are sent."""
        if self.control.leases:
            self.control.expire()
        for call_id, value, err in self.control.poll():
            self.out.put(m.Error(500, f"lookup failed: {err}", call_id=call_id) if err is not None
                         else m.Result(call_id, value))

    def stats(self) -> dict[str, Any]:
        core = self.core
        s = core.scheduler.stats
        pages = {"device": _pages(core.runner.pool.allocator)}
        if core.runner.pool.windows is not None:  # a hybrid SWA L1: the sliding layers' window pool
            pages["device_window"] = _pages(core.runner.pool.windows.allocator)
        host = getattr(core, "host_pool", None)
        if host is not None:
            pages["host"] = _pages(host.allocator)
        return {
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "cached_by_tier": dict(s.cached_by_tier),
            "generated_tokens": s.generated_tokens,
            "retractions": s.retractions,
            "forward_passes": s.forward_passes,
            "running": len(core.scheduler.running),
            "waiting": len(core.scheduler.waiting),
            "sessions": len(core.sessions),
            "pages": pages,
            "storage": core.storage_stats(),
            "tenants": self.control.tenant_snapshot(),  # + pinned pages (cache_control, pins)
            "bytes_per_page": self._bytes_per_page(),
            **({"state_slots": self._state_slots()} if core.runner.state_pool is not None else {}),
            **({"pd": core.role.stats()} if core.role is not None else {}),
            **({"speculative": core.speculative.stats_dict()} if core.speculative is not None else {}),
        }

    def _state_slots(self) -> dict[str, dict[str, int]]:
        """The recurrent-state component (a model with state layers): slots per tier, those the tree's
        snapshots hold, and a slot's bytes."""
        core = self.core
        out = {}
        for tier, pool in (("device", core.runner.state_pool), ("host", core.host_state_pool)):
            if pool is not None:
                out[tier] = {"total": pool.num_slots, "used": pool.num_used,
                             "snapshots": core.tree.state.cached_slots(tier), "bytes_per_slot": pool.bytes_per_slot}
        return out

    def _bytes_per_page(self) -> dict[str, int]:
        pool = self.core.runner.pool
        out = {"device": int(pool.bytes_per_page)}
        if getattr(self.core, "host_pool", None) is not None:
            out["host"] = int(self.core.host_pool.bytes_per_page)  # its encoding's
        if getattr(self.core, "storage", None) is not None:
            out["storage"] = int(self.core.storage.tier.codec.value_nbytes)
        return out


def _pages(alloc: Any) -> dict[str, int]:
    return {"total": alloc.num_pages, "used": alloc.num_used}
