"""The engine process's shutdown: persist the cache to L3 and say exactly what was written.

``shutdown_core`` wraps ``EngineCore.shutdown``: with L3 it aborts the live requests (their
computed pages go into the tree), checks the tree (a broken tree is never written to L3),
writes every cached page on to L3 and logs "persisted N pages to L3, M not written".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.engine.core import EngineCore

log = logging.getLogger("hicache.engine")


@dataclass
class PersistReport:
    """What a shutdown left on L3, counted over the tree's pages (those it held when the
    shutdown began, and any added since)."""

    persisted: int  # cached pages known to be on L3 at the end (written now, before, or found there)
    not_written: int  # cached pages that are not on L3 (no room in L2 for their copy, a failed write ...)
    written_now: int  # pages the shutdown itself wrote
    error: str | None = None  # the shutdown raised (the counts are what the tree says afterwards)

    def line(self) -> str:
        return (f"persisted {self.persisted} pages to L3, {self.not_written} not written "
                f"({self.written_now} written during shutdown)")


def shutdown_core(core: EngineCore, persist: bool = True) -> PersistReport | None:
    """``core.shutdown`` with a report: with L3 and ``persist``, the live requests are aborted
    (their computed pages go into the tree), the tree is checked (a broken tree is never
    written to L3), every cached page is written on to L3, and the outcome is logged as
    "persisted N pages to L3, M not written". Returns None when nothing was persisted."""
    pd = getattr(core, "role", None)
    if pd is not None:  # PD: stop the bootstrap channel and the transport; held pages go back
        try:
            pd.close()
        except Exception:
            log.exception("closing the PD role failed")
    storage = getattr(core, "storage", None)
    if storage is not None and persist:
        sched = core.scheduler
        try:
            for r in [*sched.waiting, *sched.running]:
                sched.abort(r.rid)
            core.check_integrity()
        except Exception as e:
            log.error("the cache is inconsistent (%s: %s): nothing is persisted to L3", type(e).__name__, e)
            persist = False
    if storage is None or not persist:
        core.shutdown(persist=False)
        return None
    ps = core.config.cache.page_size
    nodes = {nd.id: nd for nd in core.tree.nodes()}
    written = storage.pages_written
    log.info("persisting %d cached pages to L3 ...", sum(len(nd.key) // ps for nd in nodes.values()))
    error = None
    try:
        core.shutdown(persist=True)
    except Exception as e:
        log.exception("persisting the cache to L3 failed")
        error = f"{type(e).__name__}: {e}"
    nodes.update((nd.id, nd) for nd in core.tree.nodes())  # a node split since: both halves count
    total = sum(len(nd.key) // ps for nd in nodes.values())
    stored = sum(min(nd.storage_pages, len(nd.key) // ps) for nd in nodes.values())
    report = PersistReport(stored, total - stored, storage.pages_written - written, error)
    (log.warning if report.not_written or error else log.info)("shutdown: %s", report.line())
    return report
