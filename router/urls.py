"""A worker's URL as the router's config, flags and admin routes accept it: ``http(s)://host[:port]``
and nothing else, never the router itself.

No userinfo, path (but an empty one or ``/``), query or fragment: the router appends its own
paths (``/generate``, ``/health``, ...) to the URL, so anything more would make it call other
routes than the workers' (``http://w:1/internal/admin?next=``) or send credentials it was not
given. The port may be left out (80 / 443). A URL that names the router's own address and port
is refused (:func:`check_not_self`: its bind address, and when that is loopback or every
interface, any loopback or unspecified address and ``localhost``); an alias it cannot see (a
name or another address of this machine) is caught at the health check: the router's own
``/health`` answers with :data:`ROUTER_ID_HEADER`, and a "worker" that answers with this
router's id is this router (router/workers.py).
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

ROUTER_ID_HEADER = "x-hicache-router-id"  # on the router's /health: who answered
_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_SHAPE = "http(s)://host:port"


def check_url(url: str) -> str:
    """``url`` as ``scheme://host[:port]`` (no trailing ``/``); a ValueError naming what is wrong."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"worker url must be {_SHAPE}, got {url!r}")
    shown = url if len(url) <= 200 else url[:200] + "..."
    if any(c.isspace() or ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise ValueError(f"worker url must be {_SHAPE} without spaces or control characters, got {shown!r}")
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unclosed [ of an IPv6 address
        raise ValueError(f"worker url must be {_SHAPE}, got {shown!r}") from None
    if parts.scheme.lower() not in _DEFAULT_PORTS or not url.lower().startswith(parts.scheme.lower() + "://"):
        raise ValueError(f"worker url must be {_SHAPE} (scheme http or https), got {shown!r}")
    if "@" in parts.netloc:
        raise ValueError(f"worker url must be {_SHAPE} without user info (user:password@), got {shown!r}")
    if parts.path not in ("", "/"):
        raise ValueError(f"worker url must be {_SHAPE} without a path (the router adds the routes), got {shown!r}")
    if parts.query or "?" in url:
        raise ValueError(f"worker url must be {_SHAPE} without a query (?...), got {shown!r}")
    if parts.fragment or "#" in url:
        raise ValueError(f"worker url must be {_SHAPE} without a fragment (#...), got {shown!r}")
    host = parts.hostname or ""
    if not host or (_ip(host) is None and not _HOST_NAME.match(host)):
        raise ValueError(f"worker url must be {_SHAPE} with a host name or IP address, got {shown!r}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"worker url must be {_SHAPE} with a port in 1..65535, got {shown!r}")
    return f"{parts.scheme.lower()}://{parts.netloc.rstrip(':')}"


def normal_url(url: str) -> str:
    """``url`` as :func:`check_url` gives it when it is valid, else without its trailing ``/`` (to
    look a worker up: an invalid URL is no worker's)."""
    try:
        return check_url(url)
    except ValueError:
        return url.rstrip("/")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _local(host: str) -> bool:
    """Loopback (127/8, ::1, localhost) or unspecified (0.0.0.0, ::: a connection goes to this machine)."""
    ip = _ip(host)
    if ip is None:
        return host.lower().rstrip(".") == "localhost"
    return ip.is_loopback or ip.is_unspecified or (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def is_self(url: str, host: str, port: int) -> bool:
    """Whether ``url`` (checked by :func:`check_url`) names the router listening on ``host:port``."""
    parts = urlsplit(url)
    if (parts.port or _DEFAULT_PORTS[parts.scheme]) != port:
        return False
    name = (parts.hostname or "").lower()
    own = host.lower().strip("[]")
    if name == own or (_ip(name) is not None and _ip(name) == _ip(own)):
        return True
    return _local(name) and _local(own)


def check_not_self(url: str, host: str, port: int) -> str:
    """``url`` unless it is the router itself (then a ValueError naming that)."""
    if is_self(url, host, port):
        raise ValueError(f"worker url {url} is this router itself (it listens on {host}:{port}): a router "
                         "cannot be its own worker")
    return url
