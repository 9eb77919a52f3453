"""The engine loop's message dispatch: each typed message from the HTTP process to its handler.

A ``GenerateReq`` goes to the request table (serving.engine.requests), an ``AbortReq`` aborts
its request, ``Shutdown`` stops the loop; every other message is a call (sessions, cache flush,
the KV control API, integrity, stats, cache events) answered with a ``Result`` or an ``Error``
carrying its ``call_id``. A call whose caller stopped waiting (past its ``deadline``: the HTTP
side answered 504) is not run. The loop that feeds it: serving.engine.loop.
"""

from __future__ import annotations

import logging
import time
import traceback
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from serving import ipc as m
from serving.cache.kv_control import ControlError, KVControl
from serving.engine.cache_events import CacheEventLog
from serving.engine.housekeeping import Housekeeping
from serving.engine.requests import Outbox, RequestTable

if TYPE_CHECKING:
    from serving.engine.core import EngineCore

log = logging.getLogger("hicache.engine")


class Dispatch:
    """Routes the HTTP process's messages to the request table, the EngineCore and the KV control.

    Concurrency contract: the loop thread only, which takes the messages from the inbox's queue
    (the receiver thread never calls it); no lock. A handler runs to its end without waiting,
    except a call's own work on the EngineCore (a cache flush, say); an L3 lookup's Future is
    handed to the KV control, whose answer the housekeeping sends on a later turn."""

    def __init__(self, core: EngineCore, control: KVControl, requests: RequestTable, housekeeping: Housekeeping,
                 events: CacheEventLog | None, out: Outbox) -> None:
        self.core = core
        self.control = control
        self.requests = requests
        self.housekeeping = housekeeping
        self.events = events
        self.out = out

    def handle(self, msg: m.Message) -> bool:
        """Handle one message; False when it asks the loop to stop (``Shutdown``)."""
        if isinstance(msg, m.GenerateReq):
            self.requests.generate(msg)
        elif isinstance(msg, m.AbortReq):
            self.requests.abort(msg.rid)
        elif isinstance(msg, m.Shutdown):
            return False
        else:
            self._call(msg)
        return True

    def _call(self, msg: m.Message) -> None:
        call_id = msg.call_id  # type: ignore[union-attr]
        deadline = getattr(msg, "deadline", 0.0)
        if deadline and time.monotonic() > deadline:  # its caller answered 504 already: not done
            log.warning("%s not run: its caller stopped waiting %.1f s ago (engine_call_timeout_s)",
                        type(msg).__name__, time.monotonic() - deadline)
            return
        try:
            value = self._call_value(msg)
        except KeyError as e:
            self.out.put(m.Error(404, str(e.args[0]) if e.args else "not found", call_id=call_id))
        except ControlError as e:
            self.out.put(m.Error(e.status, str(e), call_id=call_id))
        except Exception as e:
            log.exception("call %s failed", type(msg).__name__)
            self.out.put(m.Error(500, f"{type(msg).__name__} failed: {e}", call_id=call_id))
        else:
            if isinstance(value, Future):  # answered by Housekeeping.control_turn once it is done
                self.control.defer(call_id, value)
            else:
                self.out.put(m.Result(call_id, value))

    def _call_value(self, msg: m.Message) -> Any:
        core = self.core
        if isinstance(msg, m.OpenSession):  # 409 for an open id, 429 at a cap (serving/cache/kv_sessions.py)
            return core.open_session(self.control.retention.open_session(msg.session_id, msg.tenant, msg.retention))
        if isinstance(msg, m.CloseSession):
            self.control.retention.check_session(msg.session_id, msg.tenant)
            core.close_session(msg.session_id)
            self.control.retention.close_session(msg.session_id)
            return True
        if isinstance(msg, m.FlushCache):  # pin leases and breakpoints keep their pages (kv_control.py)
            self.control.expire()
            if not core.flush_cache(keep=self.control.held_pages(), clear_storage=msg.clear_storage):
                return False
            return {**self.control.flushed(), "cleared_storage": msg.clear_storage}  # kept_leases, ...
        if isinstance(msg, m.KVControlCall):
            return self.control.call(msg.op, msg.args, msg.tenant)
        if isinstance(msg, m.CheckIntegrity):
            try:
                core.check_integrity()
                self.control.check_integrity()
            except AssertionError as e:
                return {"ok": False, "error": str(e) or traceback.format_exc(), **self.housekeeping.stats()}
            return {"ok": True, **self.housekeeping.stats()}
        if isinstance(msg, m.Stats):
            return self.housekeeping.stats()
        if isinstance(msg, m.CacheEvents):
            if self.events is None:
                raise KeyError("cache events are off (start the server with --enable-cache-events)")
            return self.events.read(msg.since, msg.epoch)
        raise TypeError(f"unexpected message {type(msg).__name__}")
