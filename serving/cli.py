"""``hicache``: serve | convert | router.

``hicache serve --config configs/l3.yaml [--flag value ...]``: a flag overrides the file, the
file overrides the defaults of the frozen config dataclasses. Every dataclass field of a
simple type gets a flag named after it, SGLang-style (``max_running_requests`` ->
``--max-running-requests``); defaults are shown from the dataclasses, never repeated here.
The API key may also come from the environment, ``HICACHE_API_KEY`` (a flag shows in ``ps``):
``--api-key`` wins over the variable, the variable over the config file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from serving.server.config import SECTIONS, ConfigError, field_types, load_config

_SCALARS = (str, int, float)
API_KEY_ENV = "HICACHE_API_KEY"


def _flag_type(tp: Any) -> Any:
    """The argparse type of a field (``int | None`` -> int); None for fields without a flag."""
    args = (
        typing.get_args(tp)
        if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
        else (tp,)
    )
    real = [a for a in args if a is not type(None)]
    if len(real) == 1 and (real[0] in _SCALARS or real[0] is bool):
        return real[0]
    return None


FLAG_ALIASES = {"tp_size": ("--tensor-parallel-size",), "dp_size": ("--data-parallel-size",)}  # SGLang/vLLM


def add_serve_args(parser: argparse.ArgumentParser) -> dict[str, tuple[str, str]]:
    """Add ``--config`` and one flag per config field; returns ``dest -> (section, field)``."""
    parser.add_argument(
        "--config", metavar="YAML", help="config file (sections model, cache, scheduler, server)"
    )
    dests: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} (config section '{section}:')")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for name, tp in field_types(cls).items():
            kind = _flag_type(tp)
            if kind is None:
                continue
            if name in dests:
                raise RuntimeError(f"config field {name!r} is in both {dests[name][0]} and {section}")
            flag = "--" + name.replace("_", "-")
            flags = (flag, *FLAG_ALIASES.get(name, ()))
            help_ = f"default: {defaults[name]!r}"
            if kind is bool:
                group.add_argument(
                    *flags,
                    dest=name,
                    action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS,
                    help=help_,
                )
            else:
                group.add_argument(
                    *flags,
                    dest=name,
                    type=kind,
                    default=argparse.SUPPRESS,
                    metavar=kind.__name__.upper(),
                    help=help_,
                )
            dests[name] = (section, name)
    return dests


def _overrides(args: argparse.Namespace, dests: dict[str, tuple[str, str]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for dest, (section, name) in dests.items():
        if hasattr(args, dest):
            out.setdefault(section, {})[name] = getattr(args, dest)
    return out


def serve_overrides(
    args: argparse.Namespace, dests: dict[str, tuple[str, str]], environ: Any = os.environ
) -> dict[str, dict[str, Any]]:
    """The flags' overrides, plus the API key from ``HICACHE_API_KEY`` unless ``--api-key`` is given."""
    out = _overrides(args, dests)
    key = environ.get(API_KEY_ENV)
    if key and "api_key" not in out.get("server", {}):
        out.setdefault("server", {})["api_key"] = key
    return out


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, tuple[str, str]]]:
    from serving import convert

    parser = argparse.ArgumentParser(prog="hicache", description="LLM serving with a hierarchical KV cache")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,convert,router}")
    serve = sub.add_parser("serve", help="run the HTTP server (OpenAI-compatible and SGLang-native)")
    dests = add_serve_args(serve)
    convert.add_convert_args(sub.add_parser("convert", help="convert a GGUF file into a HF model folder"))
    from router.cli import add_router_args

    add_router_args(sub.add_parser("router", help="cache-aware router over many servers"))
    return parser, dests


def main(argv: Sequence[str] | None = None) -> int:
    parser, dests = build_parser()
    args = parser.parse_args(argv)
    if args.command == "convert":
        from serving import convert

        convert.run_convert(args)
        return 0
    if args.command == "router":
        from router.cli import run

        return run(args)
    try:
        cfg = load_config(args.config, serve_overrides(args, dests))
    except ConfigError as e:
        print(f"hicache serve: {e}", file=sys.stderr)
        return 2
    if cfg.engine.model.tp_size > 1 and cfg.server.disaggregation_mode != "null":
        print("hicache serve: PD disaggregation with --tp-size > 1 is not supported", file=sys.stderr)
        return 2
    if cfg.server.dp_size > 1:  # N replicas behind the router, started from this same command line
        from serving.parallel.dp import run_dp

        argv = list(sys.argv[1:] if argv is None else argv)
        return run_dp(cfg, argv[argv.index("serve") + 1:])
    from serving.server.launch import run_server

    return run_server(cfg)


if __name__ == "__main__":
    sys.exit(main())
