"""The ``Host`` rules that stop DNS rebinding, shared by the worker's HTTP server
(serving/server/trusted_hosts.py) and the router (router/trusted_hosts.py), each of which refuses in
its own error shape.

A page on ``http://evil.example:30000`` whose name the attacker re-points at 127.0.0.1 (or at a
LAN address) reaches a server as the same origin: its requests carry ``Host`` and ``Origin`` of
evil.example, so comparing them proves nothing. A browser always sends the name it resolved in
``Host``, so a server answers only to names it knows:

- always: IP literals (``127.0.0.1``, ``[::1]``, ``10.1.2.3``: no DNS, nothing to rebind) and
  ``localhost``;
- when it listens on an address other than loopback (``--host 0.0.0.0``, a LAN address or
  name): also the ``--host`` name and the machine's host name (``socket.gethostname()``), the
  names a router or a proxy uses to reach a worker;
- every name in ``--allowed-hosts`` (comma-separated; ``*.example.com`` takes the subdomains of
  example.com, ``*`` any name, which turns the check off).

The port is not checked. A request without ``Host`` (HTTP/1.0, never a browser) passes, and so
does ``/health`` (``OPEN_PATHS``: liveness probes send whatever name they were given). Pure
functions and an immutable policy: safe from any thread.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import urlsplit

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
    """Which ``Host`` names a server answers to (the rules in the module docstring)."""

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
    """Whether an ``Origin`` header names the host of a ``Host`` header (port included)."""
    try:
        netloc = urlsplit(origin.decode("latin-1")).netloc
    except ValueError:
        return False
    return bool(netloc) and netloc.lower() == host.decode("latin-1").lower()
