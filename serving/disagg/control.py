"""The PD control channel: a small HTTP server in the engine process, and its client.

Each PD engine process runs one :class:`ControlServer` thread. On a prefill server it
listens on ``--disaggregation-bootstrap-port`` (decode servers PUT their
:class:`~serving.disagg.protocol.DecodeTarget` there); on a decode server it listens on an
ephemeral port (prefill servers POST each room's :class:`~serving.disagg.protocol.KVDone`
to the ``notify_url`` the target named).

Concurrency contract: the server's handler threads only parse and validate a message and
put it on :attr:`ControlServer.inbox` (a thread-safe queue); the scheduler thread drains the
inbox in its role's ``step``. Nothing else is shared. :func:`post_json` blocks (it runs on
a role's I/O thread, never on the scheduler thread).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from serving.disagg.protocol import DecodeTarget, KVDone

log = logging.getLogger("hicache.pd")
MAX_BODY = 16 * 2**20
MAX_INBOX = 4096
ROUTES: dict[str, Callable[[Any], Any]] = {"/pd/target": DecodeTarget.from_dict, "/pd/done": KVDone.from_dict}


class ControlServer:
    def __init__(self, host: str, port: int, info: dict[str, Any]) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.info = info
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:  # quiet: requests are counted, not logged
                pass

            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/pd/info":
                    self._reply(200, outer.info)
                else:
                    self._reply(404, {"error": f"no route {self.path}"})

            def do_POST(self) -> None:  # noqa: N802
                parse = ROUTES.get(self.path)
                if parse is None:
                    self._reply(404, {"error": f"no route {self.path}"})
                    return
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    n = -1
                if not 0 < n <= MAX_BODY:
                    self._reply(400 if n <= 0 else 413, {"error": "a JSON body of 1 byte .. 16 MiB is required"})
                    return
                try:
                    msg = parse(json.loads(self.rfile.read(n)))
                except (ValueError, UnicodeDecodeError) as e:
                    self._reply(400, {"error": str(e)})
                    return
                if outer.inbox.qsize() >= MAX_INBOX:  # the engine is not draining: refuse, do not queue forever
                    self._reply(429, {"error": f"{MAX_INBOX} control messages are waiting; try later"})
                    return
                outer.inbox.put(msg)
                self._reply(200, {"ok": True})

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="hicache-pd-control", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def drain(self) -> list[Any]:
        out = []
        while True:
            try:
                out.append(self.inbox.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def post_json(url: str, body: dict[str, Any], timeout: float) -> None:
    """POST ``body``; raise ``ConnectionError`` naming ``url`` unless it answers 200."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our own peers' URLs
            resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode(errors="replace")
        raise ConnectionError(f"{url} answered {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ConnectionError(f"{url} is unreachable: {e}") from None
