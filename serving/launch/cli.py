"""``hicache``: serve | convert | router.

``hicache serve --config configs/l3.yaml [--flag value ...]``: a flag overrides the file, the
file overrides the defaults of the frozen config dataclasses. Every dataclass field of a
simple type gets a flag named after it, SGLang-style (``max_running_requests`` ->
``--max-running-requests``; a mapping such as ``hicache_storage_backend_extra_config`` takes
JSON). ``--help`` is generated from the dataclasses: each flag's description is its field's
comment, its allowed values are the field's choices (hicache.config_fields), and its default is
the effective one: the config file's value under ``--config``, else the dataclass's.
The API key may also come from the environment, ``HICACHE_API_KEY`` (a flag shows in ``ps``):
``--api-key`` wins over the variable, the variable over the config file.

SGLang's launch-line flags that are not config fields (``--enable-hierarchical-cache``,
``--trust-remote-code``, ...) are serving/launch/sglang_compat.py's: each is mapped onto the config,
or accepted with one line saying it changes nothing here, or refused in one line.
``python -m serving.launch_server ARGS`` is ``hicache serve ARGS`` (SGLang's spelling).

Every configuration error is one line and exit status 2, before anything loads: the values
(the dataclasses), then what needs the file system or the model's config.json
(serving.server.preflight).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from hicache.config_fields import field_choices, field_docs
from serving.launch import sglang_compat
from serving.server.config import (
    SECTIONS,
    ConfigError,
    field_types,
    load_config,
    read_chat_template,
    read_config_file,
)

_SCALARS = (str, int, float)
API_KEY_ENV = "HICACHE_API_KEY"
SERVE_USAGE = "hicache serve [-h] [--config YAML] [--FLAG VALUE ...]"


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r}")
    return value


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
    if len(real) == 1 and (real[0] is dict or typing.get_origin(real[0]) is dict):
        return _json_object
    return None


FLAG_ALIASES = {"tp_size": ("--tensor-parallel-size", "--tp"), "dp_size": ("--data-parallel-size", "--dp")}  # SGLang


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _help(doc: str | None, default: Any, source: str | None) -> str:
    text = (doc or "").rstrip(".")
    shown = json.dumps(default) if isinstance(default, dict) else "unset" if default is None else repr(default)
    where = f" from {source}" if source else ""
    return (f"{text} (default: {shown}{where})" if text else f"default: {shown}{where}").replace("%", "%%")


def add_serve_args(parser: argparse.ArgumentParser, file_values: dict[str, dict[str, Any]] | None = None,
                   source: str | None = None) -> dict[str, tuple[str, str]]:
    """Add ``--config`` and one flag per config field; returns ``dest -> (section, field)``.
    ``file_values``: the config file's sections (``source`` names it), shown as the defaults."""
    parser.add_argument(
        "--config", metavar="YAML", help="config file (sections model, cache, scheduler, server); flags override it"
    )
    file_values = file_values or {}
    dests: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} (config section '{section}:')")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        docs = field_docs(cls)
        in_file = file_values.get(section) if isinstance(file_values.get(section), dict) else {}
        for name, tp in field_types(cls).items():
            kind = _flag_type(tp)
            if kind is None:
                continue
            if name in dests:
                raise RuntimeError(f"config field {name!r} is in both {dests[name][0]} and {section}")
            flag = "--" + name.replace("_", "-")
            flags = (flag, *FLAG_ALIASES.get(name, ()))
            default, where = (in_file[name], source) if name in in_file else (_default(fields[name]), None)
            help_ = _help(docs.get(name), default, where)
            choices = field_choices(fields[name])
            if kind is bool:
                group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_)
            else:
                # choices are shown, not enforced here: the dataclass refuses others in one line
                metavar = "{" + ",".join(choices) + "}" if choices else \
                    "JSON" if kind is _json_object else kind.__name__.upper()
                group.add_argument(*flags, dest=name, type=kind, default=argparse.SUPPRESS, metavar=metavar,
                                   help=help_)
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


def _file_values(argv: Sequence[str]) -> tuple[dict[str, Any], str | None]:
    """The sections of ``serve``'s ``--config`` file, for --help's defaults ({} when unreadable:
    the real load reports that)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    path = pre.parse_known_args(list(argv))[0].config
    if path is None:
        return {}, None
    try:
        return read_config_file(path), path
    except ConfigError:
        return {}, None


def build_parser(argv: Sequence[str] | None = None) -> tuple[argparse.ArgumentParser, dict[str, tuple[str, str]]]:
    """The parser; ``argv`` (the command line, when known) lets ``serve --help`` show its config
    file's values as defaults and spares ``serve`` importing the converter (and torch)."""
    argv = list(argv or [])
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="hicache", description="LLM serving with a hierarchical KV cache")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,convert,router}")
    serve = sub.add_parser(
        "serve", help="run the HTTP server (OpenAI-compatible and SGLang-native)", usage=SERVE_USAGE,
        description="Run the HTTP server. Flags override the --config file; the defaults shown are the "
                    "effective ones (the file's value where it sets one).")
    values, source = _file_values(argv[argv.index("serve") + 1:]) if command == "serve" else ({}, None)
    dests = add_serve_args(serve, values, source)
    sglang_compat.add_args(serve)  # SGLang's launch-line flags that are not config fields
    serve.set_defaults(command_parser=serve)
    convert_parser = sub.add_parser("convert", help="convert a GGUF file into a HF model folder")
    convert_parser.set_defaults(command_parser=convert_parser)
    if command in (None, "convert"):
        from serving import convert

        convert.add_convert_args(convert_parser)
    router_parser = sub.add_parser("router", help="cache-aware router over many servers")
    router_parser.set_defaults(command_parser=router_parser)
    if command in (None, "router"):
        from router.cli import add_router_args

        add_router_args(router_parser)
    return parser, dests


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, dict[str, tuple[str, str]]]:
    """Parse ``argv``; an unknown flag is reported by its command's parser (its usage, exit 2)."""
    parser, dests = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args, dests


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, dests = parse(argv)
    if args.command == "convert":
        from serving import convert

        convert.run_convert(args)
        return 0
    if args.command == "router":
        from router.cli import run

        return run(args)
    try:
        overrides = serve_overrides(args, dests)
        notes = sglang_compat.apply(args, overrides)  # ConfigError for a refused one
        cfg = load_config(args.config, overrides)
        if cfg.server.chat_template:
            read_chat_template(cfg.server.chat_template)  # a file that cannot be read: one line, here
        if cfg.engine.model.tp_size > 1 and cfg.server.disaggregation_mode != "null":
            raise ConfigError("--tp-size > 1 with --disaggregation-mode: PD disaggregation with tensor "
                              "parallelism is not supported (allowed: --tp-size 1)")
        from serving.server.preflight import preflight

        preflight(cfg)  # what needs the file system or the model's config.json, before anything loads
    except ConfigError as e:
        print(f"hicache serve: {e}", file=sys.stderr)
        return 2
    for note in notes:  # one line per SGLang flag: what it did, or why it changes nothing here
        print(f"hicache serve: {note}", file=sys.stderr, flush=True)
    if cfg.server.dp_size > 1:  # N replicas behind the router, started from this same command line
        from serving.launch.dp import run_dp

        return run_dp(cfg, argv[argv.index("serve") + 1:])
    from serving.server.serve import run_server

    code = run_server(cfg)
    # Both processes are down; the interpreter's exit would still walk every object the HTTP stack
    # made in its final collections (~0.8 s of CPU): frozen, they are left to the OS.
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
