"""A warm drain's engine side (the HTTP route is serving/server/drain_api.py): write every cached L1/L2
page that L3 lacks on to L3, and say what this engine holds that another worker should take
over (open sessions, pin leases), so a router can re-home them (router/worker_drain.py).

The report is what a router needs to re-home them, and nothing more (it reaches the admin only:
``POST /drain`` needs the admin key): each session's id (the client's, in its tenant's namespace:
serving/scoped_ids.py), tenant and retention hints; each pin lease's id, tenant, prompt ids (the
target re-pins them), the request's own ``cache_salt`` (``request_salt``: the target combines it
with the tenant's seed again), its time left and whether it is a cache_control breakpoint. Never
an effective salt: a tenant's seed (common/tenants.py) does not leave the server.

The HTTP side calls this once no request is running or waiting (it stopped admitting first).
With L3: the L1-only nodes get an L2 copy, then every L2 page not in L3 is written (the writes
are waited for, as at shutdown: serving/engine/shutdown.py), and the counts are taken over the
tree's pages: ``written_pages`` (by this drain), ``l3_pages`` (known to be on L3 now, written
earlier or found there), ``not_written`` (no L2 room for a copy, a failed write). Without L3
nothing can be handed over and the report says so (``l3: false``).

Concurrency contract: engine loop thread (a KV control call); it blocks the loop for the writes,
which is what a drain is for: nothing else runs on a draining engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from serving.cache.control_core import ControlCore
from serving.cache.kv_control_limits import ControlError
from serving.scoped_ids import unscoped

if TYPE_CHECKING:
    from serving.cache.kv_control import KVControl


def persist(core: ControlCore) -> dict[str, Any]:
    storage = core.storage
    if storage is None:
        return {"l3": False, "written_pages": 0, "l3_pages": 0, "not_written": 0, "tree_pages": 0}
    ps = core.config.cache.page_size
    written = storage.pages_written
    core.tree.backup_all()
    core.req_cache.flush_transfers()  # runs the backups, then hands them to the L3 writers
    storage.persist_all()  # every L2 page not on L3 yet; waits for the writes
    nodes = list(core.tree.nodes())
    total = sum(len(nd.key) // ps for nd in nodes)
    stored = sum(min(nd.storage_pages, len(nd.key) // ps) for nd in nodes)
    return {"l3": True, "written_pages": storage.pages_written - written, "l3_pages": stored,
            "not_written": total - stored, "tree_pages": total}


def drain_report(control: KVControl) -> dict[str, Any]:
    """Persist to L3 (see the module docstring); the open sessions and the live pin leases."""
    core = control.core
    sched = core.scheduler
    busy = len(sched.running) + len(sched.waiting) or int(sched.has_work)  # (a last token still pending)
    if busy:  # the HTTP side waits for them first; a request let in since is not cut off here
        raise ControlError(409, f"{busy} requests are still running or waiting: the drain persists once they "
                                "finished")
    control.expire()
    now = control.now()
    report = persist(core)
    sessions = [{"session_id": unscoped(key), "tenant": tenant,
                 "retention": dict(control.sessions.retention.get(key, {}))}
                for key, tenant in control.sessions.owner.items()]
    points = control.breakpoints.breakpoint_leases()
    leases = [{"lease_id": x.lease_id, "breakpoint": x.lease_id in points, "tenant": x.tenant,
               "input_ids": list(x.input_ids), "request_salt": x.request_salt, "ttl_s": max(0.001, x.expires - now)}
              for x in control.leases.values() if x.session_id is None and x.input_ids is not None]
    return {**report, "sessions": sessions, "leases": leases}
