"""The ``Host`` header check that stops DNS rebinding.

A page on ``http://evil.example:30000`` whose name the attacker re-points at 127.0.0.1 (or at a
LAN address) reaches this server as the same origin: its requests carry ``Host`` and
``Origin`` of evil.example, so comparing them proves nothing, and without an API key the page
could drive the server. A browser always sends the name it resolved in ``Host``, so the server
answers only to names it knows:

- always: IP literals (``127.0.0.1``, ``[::1]``, ``10.1.2.3``: no DNS, nothing to rebind) and
  ``localhost``;
- when it listens on an address other than loopback (``--host 0.0.0.0``, a LAN address or
  name): also the ``--host`` name and the machine's host name (``socket.gethostname()``), the
  names a router or a proxy uses to reach a worker;
- every name in ``--allowed-hosts`` (comma-separated; ``*.example.com`` takes the subdomains of
  example.com, ``*`` any name, which turns the check off).

The port is not checked. A request with another name gets a 403 naming the header; one
without ``Host`` (HTTP/1.0, never a browser) passes, and so does ``/health`` (liveness probes
of load balancers send whatever name they were given).
"""

from __future__ import annotations

import ipaddress
import re
import socket

from starlette.types import ASGIApp, Receive, Scope, Send

from serving.server.http_io import asgi_refuse

OPEN_PATHS = frozenset({"/health"})
_NAME = re.compile(r"^(\*\.)?[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?$")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name[1:-1] if name.startswith("[") and name.endswith("]") else name)
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    ip = _ip(host)
    return host.lower() == "localhost" if ip is None else ip.is_loopback


def parse_allowed_hosts(value: str | None) -> tuple[str, ...]:
    """``--allowed-hosts`` as lower-case names; ValueError naming a malformed entry."""
    out = []
    for entry in (value or "").split(","):
        name = entry.strip().lower()
        if not name:
            continue
        if name != "*" and _ip(name) is None and not _NAME.match(name):
            raise ValueError(f"allowed_hosts: {entry.strip()!r} is not a host name, *.domain, an IP literal or *")
        out.append(name)
    return tuple(out)


def host_name(header: str) -> str | None:
    """The name in a ``Host`` header (port dropped, lower case); None if it is not one."""
    header = header.strip().lower()
    if header.startswith("["):  # [v6]:port
        end = header.find("]")
        name, rest = header[: end + 1], header[end + 1:]
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return name if _ip(name) is not None else None
    name, colon, port = header.rpartition(":")
    if not colon:
        name = header
    elif not port.isdigit():
        return None
    return name if name and (_NAME.match(name) and not name.startswith("*")) else None


class HostPolicy:
    """Which ``Host`` names this server answers to (see the module docstring)."""

    def __init__(self, bind_host: str, allowed_hosts: str | None = None) -> None:
        extra = parse_allowed_hosts(allowed_hosts)
        self.any = "*" in extra
        self.suffixes = tuple(e[1:] for e in extra if e.startswith("*."))  # ".example.com"
        names = {"localhost", *(e for e in extra if not e.startswith("*"))}
        if not is_loopback(bind_host):
            names.add(socket.gethostname().lower())
            if _ip(bind_host) is None:
                names.add(bind_host.lower())
        self.names = frozenset(names)

    def allows(self, header: str) -> bool:
        if self.any:
            return True
        name = host_name(header)
        if name is None:
            return False
        return _ip(name) is not None or name in self.names or name.endswith(self.suffixes)


class TrustedHostMiddleware:
    """403 for a request whose ``Host`` names a host this server does not answer to."""

    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        host = dict(scope["headers"]).get(b"host")
        if host is None or self.policy.allows(host.decode("latin-1")):
            return await self.app(scope, receive, send)
        shown = host.decode("latin-1")[:200]
        await asgi_refuse(send, 403, f"the Host header {shown!r} names a host this server does not answer to "
                                     "(DNS rebinding guard); start it with --allowed-hosts to add names")
