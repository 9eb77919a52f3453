"""``hicache router --config configs/router.yaml`` or ``hicache router --worker-urls URL ...``.

Every RouterConfig field of a simple type gets a flag named after it (``cache_threshold`` ->
``--cache-threshold``), ``worker_urls`` gets ``--worker-urls URL [URL ...]``, PD mode's workers
``--prefill URL [BOOTSTRAP_PORT]`` and ``--decode URL`` (router/pd_config.py); a flag overrides
the file (``--worker-urls`` replaces its list), the file overrides the dataclass defaults.
``--help`` shows each flag's description (its field's comment, hicache/config_fields.py), its
allowed values and its default. uvicorn reads connections with the router's read timeouts and
framing guard (router/connections.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from hicache.config_fields import field_choices, field_docs
from router.config import ConfigError, RouterConfig, field_types, load_config
from router.pd_config import add_pd_args

READY_MESSAGE = "The router is ready to route!"


def _flag_type(tp: Any) -> Any:
    union = isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
    real = [a for a in (typing.get_args(tp) if union else (tp,)) if a is not type(None)]
    return real[0] if len(real) == 1 and real[0] in (str, int, float, bool) else None


def _help(doc: str | None, default: Any) -> str:
    """A flag's help: its field's description (hicache/config_fields.py) and its default."""
    shown = "unset" if default is None else repr(list(default) if isinstance(default, tuple) else default)
    text = (doc or "").rstrip(".")
    return (f"{text} (default: {shown})" if text else f"default: {shown}").replace("%", "%%")


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="YAML",
                        help="router config file (a flat mapping of the fields below, e.g. configs/router.yaml); "
                             "flags override it")
    fields = {f.name: f for f in dataclasses.fields(RouterConfig)}
    docs = field_docs(RouterConfig)
    for name, tp in field_types().items():
        if name in ("prefill_urls", "decode_urls"):  # --prefill / --decode (router/pd_config.py)
            continue
        flag = "--" + name.replace("_", "-")
        help_ = _help(docs.get(name), fields[name].default)
        if name == "worker_urls":
            parser.add_argument(flag, dest=name, nargs="+", metavar="URL", default=argparse.SUPPRESS, help=help_)
            continue
        kind = _flag_type(tp)
        if kind is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_
            )
        elif kind is not None:
            choices = field_choices(fields[name])
            metavar = "{" + ",".join(choices) + "}" if choices else kind.__name__.upper()
            parser.add_argument(flag, dest=name, type=kind, metavar=metavar, default=argparse.SUPPRESS, help=help_)
    add_pd_args(parser)  # --prefill URL [BOOTSTRAP_PORT], --decode URL (prefill_urls, decode_urls)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    overrides = {name: getattr(args, name) for name in field_types() if hasattr(args, name)}
    return load_config(args.config, overrides)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"hicache router: {e}", file=sys.stderr)
        return 2
    if not cfg.worker_urls and not cfg.pd_disaggregation:
        print("hicache router: no workers (give --worker-urls, or add them with POST /add_worker)", file=sys.stderr)
    return serve(cfg)


def serve(cfg: RouterConfig) -> int:
    import uvicorn

    from router.app import create_app
    from router.connections import protocol_class

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    logging.getLogger("httpx").setLevel(logging.WARNING)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # SIGTERM: shut down and exit 0
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and not self.should_exit:
                print(READY_MESSAGE, flush=True)

    server = _Server(
        uvicorn.Config(
            create_app(cfg), host=cfg.host, port=cfg.port, http=protocol_class(cfg), log_level=cfg.log_level,
            access_log=False, lifespan="on", timeout_keep_alive=cfg.timeout_keep_alive
        )
    )
    server.run()
    return 0 if server.started else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache router", description="cache-aware router over HiCache workers")
    add_router_args(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
