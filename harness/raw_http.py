"""Raw HTTP/1.1 over plain sockets, for the tests of how a server or the router treats a
connection (slow clients, bodies that stop short, ambiguous framing): what httpx will not do on
purpose, such as sending a head a byte at a time or a Content-Length the body never reaches.

A :class:`RawHttp` names the peer (host, port) and ``bound_s``, the upper bound within which a
connection the test expects to be closed must be seen closed: a bound on a behaviour (the
connection is closed at all), not a speed target. Past it a helper fails the test with an
AssertionError. :func:`answer_of` and :func:`assert_openai_408` read the answer a peer sent
before it closed.
"""

from __future__ import annotations

import json
import select
import socket
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RawHttp:
    """A peer at ``host:port`` spoken to with raw sockets; ``bound_s`` bounds each wait for a close."""

    host: str
    port: int
    bound_s: float

    def connect(self) -> socket.socket:
        """A new TCP connection to the peer (its blocking reads time out after ``bound_s``)."""
        return socket.create_connection((self.host, self.port), timeout=self.bound_s)

    def request_line(self, method: str, path: str) -> bytes:
        """The start of a head: the request line and the Host header, no blank line."""
        return f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n".encode()

    def post_head(self, path: str, length: int | None = None, chunked: bool = False) -> bytes:
        """A whole POST head with a JSON content type, framed by ``Content-Length: length`` (when
        given) and ``Transfer-Encoding: chunked`` (when ``chunked``), in that order."""
        framing = (f"Content-Length: {length}\r\n" if length is not None else "") + \
            ("Transfer-Encoding: chunked\r\n" if chunked else "")
        return self.request_line("POST", path) + f"Content-Type: application/json\r\n{framing}\r\n".encode()

    def until_closed(self, sock: socket.socket, since: float) -> bytes:
        """What the peer sent until it closed the connection; fails past ``bound_s`` after
        ``since`` (a ``time.monotonic()``). A reset counts as a close."""
        out = b""
        while True:
            sock.settimeout(max(since + self.bound_s - time.monotonic(), 0.01))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                raise AssertionError(
                    f"the connection stayed open over {self.bound_s} s (got {out[:200]!r})") from None
            except ConnectionResetError:  # closed while a byte of ours was in flight: a reset, not a FIN
                return out
            if not chunk:
                return out
            out += chunk

    def trickle(self, n: int, first: bytes, drip: bytes, every: float) -> list[bytes]:
        """``n`` connections that send ``first`` at once, then the next byte of ``drip`` (cycled)
        every ``every`` s until the peer closes them; what each got. Fails when any is still open
        ``bound_s`` after the start."""
        socks = [self.connect() for _ in range(n)]
        t0 = time.monotonic()
        for s in socks:
            s.sendall(first)
        answers: dict[int, bytes] = {}
        pos = 0
        while len(answers) < n:
            assert time.monotonic() - t0 < self.bound_s, f"{n - len(answers)} of {n} connections still open"
            for i, s in enumerate(socks):
                if i in answers:
                    continue
                if select.select([s], [], [], 0)[0]:  # the peer answered (or closed): read to the end
                    answers[i] = self.until_closed(s, t0)
                    continue
                try:
                    s.send(drip[pos % len(drip):pos % len(drip) + 1])
                except OSError:
                    answers[i] = self.until_closed(s, t0)
            pos += 1
            time.sleep(every)
        for s in socks:
            s.close()
        return [answers[i] for i in range(n)]


def until_seen(sock: socket.socket, marker: bytes) -> bytes:
    """What the peer sent until ``marker`` appears in it (the connection stays open); fails when
    the peer closes first, and on the socket's own timeout."""
    out = b""
    while marker not in out:
        chunk = sock.recv(65536)
        assert chunk, out
        out += chunk
    return out


def one_answer(sock: socket.socket) -> bytes:
    """One whole answer whose body is sized by Content-Length (the connection stays open); fails
    when the peer closes first, and on the socket's own timeout."""
    head, _, body = until_seen(sock, b"\r\n\r\n").partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.lower().split(b"\r\n")
                  if line.startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, head + body
        body += chunk
    return head + b"\r\n\r\n" + body


def get_after_idle(raw: RawHttp, path: str, idle_s: float) -> list[bytes]:
    """Two GETs of ``path`` on one connection, ``idle_s`` apart: both answers. Fails when the peer
    closed the connection while it was idle (an empty read, or a reset)."""
    with raw.connect() as sock:
        answers = []
        for pause in (idle_s, 0.0):
            sock.sendall(raw.request_line("GET", path) + b"\r\n")
            answers.append(one_answer(sock))
            time.sleep(pause)
        return answers


def answer_of(raw: bytes, status: int) -> dict:
    """The JSON body of a whole answer that has ``status`` and closes the connection (its body
    sized by Content-Length or chunked); fails when the status or the ``Connection: close`` differ."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw[:300]
    assert b"connection: close" in head.lower(), head
    if b"transfer-encoding: chunked" in head.lower():
        data, rest = b"", body
        while True:
            size, _, rest = rest.partition(b"\r\n")
            if int(size, 16) == 0:
                break
            data, rest = data + rest[:int(size, 16)], rest[int(size, 16) + 2:]
        body = data
    return json.loads(body)


def assert_openai_408(raw: bytes, names: str) -> None:
    """``raw`` is a 408 that closes the connection, with an OpenAI-shaped error whose code is
    "408" and whose message names ``names`` (the timeout that fired, e.g. ``header_timeout_s``)."""
    err = answer_of(raw, 408)["error"]
    assert names in err["message"] and err["code"] == "408", err
