"""The engine process's ends of its two pipes: a receiver thread that reads the HTTP process's
frames while the loop thread runs forward passes, and the lock both threads send under.

Without it, a request sent while a long forward pass ran (one 2,048-token prefill chunk takes
tens of seconds on a CPU) would sit unread in the pipe until that pass ended, and the HTTP
side could not tell a busy engine from a dead one. The receiver acknowledges receipt at once
(``messages.Received``), so the HTTP side waits for the request's acceptance for as long as the
engine makes progress (the watchdog's view) instead of failing it after
``engine_call_timeout_s``. torch releases the GIL inside its kernels, so the receiver runs
while a pass computes.
"""

from __future__ import annotations

import logging
import queue
import threading
from multiprocessing.connection import Connection

from serving import ipc as m

log = logging.getLogger("hicache.engine")


class _Closed:
    """Queued by the receiver when ``rx`` ended (EOF: the HTTP process went away) or failed."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class EngineInbox:
    """Concurrency contract:

    - the receiver thread (``start()``) is the only reader of ``rx``. For each frame it decodes,
      it first sends one ``Received`` listing the frame's GenerateReq rids (when there are any),
      then puts the frame's messages on a queue. At EOF or an error on ``rx`` it queues a
      ``_Closed`` and ends;
    - the loop thread is the only reader of that queue (``get``); it never blocks on the pipe:
      ``get(timeout)`` waits on the queue only, and ``get(0)`` not at all. Messages come out in
      the order the HTTP side sent them; after the ones read before the pipe closed, ``get``
      raises the close (EOFError, or the decode error) for good;
    - both threads send on ``tx`` through ``send``: one whole frame at a time under
      ``send_lock``. A failed send (the HTTP process is gone) raises in the loop thread's
      ``send``; the receiver drops its acknowledgement and reads on until EOF.
    """

    def __init__(self, rx: Connection, tx: Connection) -> None:
        self.rx, self.tx = rx, tx
        self.send_lock = threading.Lock()
        self._queue: queue.SimpleQueue[list[m.Message] | _Closed] = queue.SimpleQueue()
        self._closed: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._receive, name="engine-receiver", daemon=True)
        self._thread.start()

    def send(self, frame: bytes) -> None:
        with self.send_lock:
            self.tx.send_bytes(frame)

    def get(self, timeout: float) -> list[m.Message]:
        """Every message received so far, waiting up to ``timeout`` seconds for the first
        (none when 0); [] when none came. Raises EOFError / the decode error once the pipe
        closed and its messages were all taken."""
        if self._closed is not None:
            raise self._closed
        try:
            item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return []
        out: list[m.Message] = []
        while True:
            if isinstance(item, _Closed):
                self._closed = item.error
                if not out:
                    raise item.error
                return out
            out.extend(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return out

    def _receive(self) -> None:
        while True:
            try:
                msgs = m.decode(self.rx.recv_bytes())
            except (EOFError, OSError) as e:
                self._queue.put(_Closed(e if isinstance(e, EOFError) else EOFError(str(e))))
                return
            except Exception as e:  # an undecodable frame: a bug on the HTTP side; the loop fails with it
                log.exception("the engine could not decode a frame from the HTTP process")
                self._queue.put(_Closed(e))
                return
            rids = [msg.rid for msg in msgs if isinstance(msg, m.GenerateReq)]
            if rids:
                try:
                    self.send(m.encode([m.Received(rids)]))
                except (OSError, ValueError):  # the HTTP side is gone (or tx closed): EOF follows
                    pass
            self._queue.put(msgs)
