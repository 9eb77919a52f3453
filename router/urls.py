"""A worker's URL as the router's config, flags and admin routes accept it."""

from __future__ import annotations


def check_url(url: str) -> str:
    """``url`` without a trailing ``/``; a ValueError unless it is ``http(s)://host...``."""
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"worker url must be http(s)://host:port, got {url!r}")
    return url.rstrip("/")
