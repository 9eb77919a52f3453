"""PD mode's settings: the forms its workers take in YAML and flags, and their validation.

SGLang's flags: ``--pd-disaggregation --prefill URL [BOOTSTRAP_PORT] ... --decode URL ...``
(``--prefill`` and ``--decode`` repeatable; a prefill without a port, or with ``none``, gets
the one its ``/server_info`` announces, else 8998). In YAML: ``pd_disaggregation: true``,
``prefill_urls: [URL, [URL, PORT], ...]``, ``decode_urls: [URL, ...]``.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from router.urls import check_url

if TYPE_CHECKING:
    from router.config import RouterConfig

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port


def prefill_entry(entry: Any) -> tuple[str, int | None]:
    """``URL``, ``[URL]``, ``[URL, PORT]`` or ``[URL, None]`` -> ``(url, port or None)``."""
    if isinstance(entry, str):
        entry = [entry]
    if not isinstance(entry, (list, tuple)) or not 1 <= len(entry) <= 2 or not isinstance(entry[0], str):
        raise ValueError(f"a prefill worker is URL or [URL, BOOTSTRAP_PORT], got {entry!r}")
    port = entry[1] if len(entry) == 2 else None
    if port is not None and (type(port) is not int or not 1 <= port <= 65535):
        raise ValueError(f"the bootstrap port of prefill worker {entry[0]} must be in 1..65535, got {port!r}")
    return check_url(entry[0]), port


def check_pd(cfg: RouterConfig) -> None:
    """Normalize ``prefill_urls`` / ``decode_urls`` (lists from YAML become tuples) and check
    that they go with ``pd_disaggregation``."""
    prefill = tuple(prefill_entry(e) for e in cfg.prefill_urls)
    decode = tuple(check_url(u) for u in cfg.decode_urls)
    object.__setattr__(cfg, "prefill_urls", prefill)  # frozen: normalized once, here
    object.__setattr__(cfg, "decode_urls", decode)
    if not cfg.pd_disaggregation:
        if prefill or decode:
            raise ValueError(
                "prefill_urls / decode_urls (--prefill / --decode) need pd_disaggregation (--pd-disaggregation)"
            )
        return
    if cfg.worker_urls:
        raise ValueError(
            "pd_disaggregation takes prefill_urls and decode_urls (--prefill / --decode), not worker_urls"
        )
    if not prefill or not decode:
        raise ValueError(
            "pd_disaggregation needs at least one prefill worker (--prefill URL [BOOTSTRAP_PORT]) "
            "and one decode worker (--decode URL)"
        )
    urls = [u for u, _ in prefill] + list(decode)
    if len(set(urls)) != len(urls):
        raise ValueError("a worker is listed twice (a worker is either a prefill or a decode worker, once)")


class _PrefillAction(argparse.Action):
    """``--prefill URL [BOOTSTRAP_PORT]``, repeatable: appends ``[url]`` or ``[url, port]``."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any, opt: Any = None) -> None:
        if not 1 <= len(values) <= 2:
            raise argparse.ArgumentError(self, f"takes URL [BOOTSTRAP_PORT], got {' '.join(values)}")
        entry: list[Any] = [values[0]]
        if len(values) == 2 and values[1].lower() != "none":
            if not values[1].isdigit():
                raise argparse.ArgumentError(self, f"the bootstrap port must be a number or none, got {values[1]!r}")
            entry.append(int(values[1]))
        setattr(ns, self.dest, [*getattr(ns, self.dest, []), entry])


def add_pd_args(parser: argparse.ArgumentParser) -> None:
    """``--pd-disaggregation`` itself comes from the RouterConfig field (router/cli.py)."""
    parser.add_argument(
        "--prefill", dest="prefill_urls", nargs="+", metavar=("URL", "BOOTSTRAP_PORT"), action=_PrefillAction,
        default=argparse.SUPPRESS, help="PD mode: a prefill worker and its bootstrap port (default: its "
        f"/server_info's, else {DEFAULT_BOOTSTRAP_PORT}); repeatable",
    )
    parser.add_argument(
        "--decode", dest="decode_urls", nargs="+", metavar="URL", action="extend", default=argparse.SUPPRESS,
        help="PD mode: decode worker(s); repeatable",
    )
