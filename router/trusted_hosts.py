"""The router's browser guards: the ``Host`` check that stops DNS rebinding, and the
cross-origin check, with the workers' rules (serving/server/trusted_hosts.py and
serving/server/app.py's SameOriginMiddleware).

The router talks to workers over HTTP only and imports nothing from serving, so the small
pure functions are copied here (keep the two in step). The router needs both guards itself:
it passes on neither the client's ``Host`` nor its ``Origin`` (its calls to a worker name the
worker URL's host, e.g. ``127.0.0.1``, and carry no ``Origin``), so the workers' own checks never
see what the browser sent.

``Host`` (a page on ``http://evil.example:30100`` whose name the attacker re-points at
127.0.0.1 is same-origin with it, so comparing ``Origin`` with ``Host`` proves nothing): the
router answers only to

- always: IP literals (no DNS, nothing to rebind) and ``localhost``;
- when it listens on an address other than loopback: also its ``--host`` name and the
  machine's host name;
- every name in ``--allowed-hosts`` (comma-separated; ``*.example.com`` takes the subdomains
  of example.com, ``*`` any name, which turns the check off).

The port is not checked. Another name gets a 403 naming the header; a request without
``Host`` passes, and so does ``/health``. Cross-origin: a state-changing request (any method
but GET / HEAD / OPTIONS) whose ``Origin`` names another host than ``Host`` is a 403 (the
router sends no CORS headers, and forwards bodies of any content type, so a form or a
text/plain ``fetch`` could otherwise flush the workers' caches or start generations). Clients
that are not browsers send no ``Origin``. Refusals answer in the shape of the path's API
(router/errors.py).
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import shape_for

OPEN_PATHS = frozenset({"/health"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
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
    """Which ``Host`` names the router answers to (see the module docstring)."""

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


def same_origin(origin: bytes, host: bytes) -> bool:
    try:
        netloc = urlsplit(origin.decode("latin-1")).netloc
    except ValueError:
        return False
    return bool(netloc) and netloc.lower() == host.decode("latin-1").lower()


async def _refuse(send: Send, path: str, message: str) -> None:
    body = json.dumps(shape_for(path).body(403, message)).encode()
    await send({"type": "http.response.start", "status": 403, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


class BrowserGuardMiddleware:
    """403 for a ``Host`` the router does not answer to, then for a cross-origin state-changing
    request (see the module docstring); runs before the routes and the API-key check."""

    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        host = headers.get(b"host")
        if host is not None and not self.policy.allows(host.decode("latin-1")):
            shown = host.decode("latin-1")[:200]
            return await _refuse(send, scope["path"], f"the Host header {shown!r} names a host this router does not "
                                                      "answer to (DNS rebinding guard); start it with --allowed-hosts "
                                                      "to add names")
        origin = headers.get(b"origin")
        if scope["method"] not in SAFE_METHODS and origin is not None and not same_origin(origin, host or b""):
            return await _refuse(send, scope["path"],
                                 f"cross-origin request refused (Origin: {origin.decode('latin-1')[:200]})")
        await self.app(scope, receive, send)
