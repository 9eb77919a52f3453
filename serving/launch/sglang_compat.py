"""SGLang's launch-line flags that are not config fields here: each one does what SGLang's does
(mapped onto the config), or is accepted with one line saying it changes nothing here and why, or
is refused with one line naming what to use instead (exit status 2, as any configuration error).

``python -m sglang.launch_server --model-path M --enable-hierarchical-cache ...`` runs unchanged as
``python -m serving.launch_server ...`` or ``hicache serve ...``. The flags that are config fields
(``--model-path``, ``--tp-size`` / ``--tp``, ``--page-size``, ``--hicache-ratio``,
``--disable-radix-cache``, ``--chat-template`` ...) are the config's (serving/launch/cli.py); the
table here covers the rest that work or change nothing; every other flag of SGLang's
(serving/launch/sglang_flags.py: all of its release's) is parsed and refused in one line naming the
table. docs/configuration.md ("SGLang launch lines") lists them all.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serving.launch.sglang_flags import sglang_flags
from serving.server.config import ConfigError

Overrides = dict[str, dict[str, Any]]
FILE_BACKEND_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # SGLang's file backend's directory
FILE_BACKEND_DIR = "/tmp/hicache"  # SGLang's default for it


@dataclass(frozen=True)
class Flag:
    name: str  # without the dashes
    takes_value: bool  # False: a switch (store_true)
    kind: str  # "map" (does what SGLang's does), "noop" (accepted, changes nothing), "refuse"
    why: str  # noop: why it changes nothing; refuse: what to use instead; map: what it does here
    apply: Callable[[Any, Overrides], str | None] | None = None  # map: edits the overrides, returns a note

    @property
    def dest(self) -> str:
        return "sglang_" + self.name.replace("-", "_")


def _enable_hierarchical_cache(_value: Any, out: Overrides) -> str | None:
    cache = out.setdefault("cache", {})
    if cache.get("hicache_ratio") or cache.get("hicache_size"):
        return None  # L2 is on by its size already
    cache["hicache_ratio"] = 2.0
    return "L2 (host memory) on at SGLang's default --hicache-ratio 2"


def _max_prefill_tokens(value: Any, out: Overrides) -> str | None:
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"--max-prefill-tokens: not an integer: {value!r}") from None
    if n < 1:
        raise ConfigError(f"--max-prefill-tokens must be at least 1, got {n}")
    sched = out.setdefault("scheduler", {})
    current = sched.get("chunked_prefill_size", 2048)
    sched["chunked_prefill_size"] = n if current == -1 else min(current, n)
    return f"prefill tokens per step capped at {sched['chunked_prefill_size']} (--chunked-prefill-size)"


_NOOP = "noop"
FLAGS: tuple[Flag, ...] = (
    Flag("enable-hierarchical-cache", False, "map", "turns L2 on (--hicache-ratio 2 unless a size is given)",
         _enable_hierarchical_cache),
    Flag("max-prefill-tokens", True, "map", "caps the prefill tokens of one step (min with --chunked-prefill-size)",
         _max_prefill_tokens),
    Flag("trust-remote-code", False, _NOOP, "no checkpoint code is ever run: the model classes are this "
         "project's own (serving/models)"),
    Flag("enable-metrics", False, _NOOP, "GET /metrics (Prometheus) is always on"),
    Flag("enable-cache-report", False, _NOOP, "usage.prompt_tokens_details.cached_tokens is always reported"),
    Flag("stream-interval", True, _NOOP, "every decoded token is streamed as soon as the HTTP process has it "
         "(tokens that arrive together go out in one chunk)"),
    Flag("hicache-io-backend", True, _NOOP, "L1 <-> L2 copies always use this project's page-copy kernels "
         "(serving/kernels)"),
    Flag("tokenizer-mode", True, _NOOP, "the tokenizer is the model's fast one (HF tokenizers)"),
    Flag("log-requests", False, _NOOP, "each request gets one access-log line (--access-log); bodies are not logged"),
    Flag("log-requests-level", True, _NOOP, "see --log-requests"),
    Flag("show-time-cost", False, _NOOP, "per-step times are in /metrics"),
    Flag("enable-torch-compile", False, _NOOP, "CUDA graphs are used (--disable-cuda-graph); torch.compile is not"),
    Flag("torch-compile-max-bs", True, _NOOP, "see --enable-torch-compile"),
    Flag("enable-mixed-chunk", False, _NOOP, "prefill chunks and decodes already share a step"),
    Flag("disable-custom-all-reduce", False, _NOOP, "tensor parallelism uses NCCL's all-reduce only"),
    Flag("enable-p2p-check", False, _NOOP, "NCCL checks peer access itself"),
    Flag("sampling-backend", True, _NOOP, "sampling is this project's own (serving/runner/sampler.py)"),
    Flag("schedule-conservativeness", True, _NOOP, "admission reserves each request's pages exactly"),
    Flag("decode-log-interval", True, _NOOP, "decode throughput is in /metrics"),
    Flag("allow-auto-truncate", False, _NOOP, "a prompt over the context length gets a 400 naming it, never "
         "silently truncated"),
    Flag("download-dir", True, _NOOP, "nothing is downloaded: --model-path is a local folder"),
    Flag("revision", True, _NOOP, "nothing is downloaded: --model-path is a local folder"),
    Flag("file-storage-path", True, _NOOP, "SGLang's file storage of the frontend language is not used"),
    Flag("load-balance-method", True, _NOOP, "--dp-size replicas sit behind the cache-aware router"),
    Flag("skip-server-warmup", False, _NOOP, "the server does no warm-up request"),
    Flag("skip-tokenizer-init", False, "refuse", "the tokenizer is always loaded; send input_ids to /generate "
         "(and read output_ids) to skip text"),
    Flag("enable-dp-attention", False, "refuse", "use --dp-size for data parallelism (replicas behind the router)"),
    Flag("cpu-offload-gb", True, "refuse", "weights stay on the device; offload KV with --hicache-ratio / "
         "--hicache-storage-backend"),
    Flag("enable-lora", False, "refuse", "LoRA adapters are not supported; merge the adapter into the weights"),
    Flag("lora-paths", True, "refuse", "LoRA adapters are not supported; merge the adapter into the weights"),
    Flag("nnodes", True, "refuse", "one node only: use --dp-size / --tp-size within it (1 is accepted)"),
    Flag("node-rank", True, "refuse", "one node only (0 is accepted)"),
    Flag("dist-init-addr", True, "refuse", "one node only: tensor parallelism starts its own group"),
    Flag("ep-size", True, "refuse", "expert parallelism is not supported: MoE experts are sharded by --tp-size "
         "(1 is accepted)"),
)
_BY_DEST = {f.dest: f for f in FLAGS}
_HARMLESS = {"nnodes": "1", "node-rank": "0", "ep-size": "1"}  # refused flags at values that change nothing


OTHER = "sglang_other__"  # the dest prefix of SGLang's flags that neither the config nor the table knows
NARGS: dict[Any, Any] = {0: 0, 1: None, "?": "?", "*": "*", "+": "+"}
ALIASES = {"--model": "--model-path"}


def add_args(parser: argparse.ArgumentParser) -> None:
    """The table's flags, in their own --help group; then every other SGLang flag, hidden (refused
    by :func:`apply`)."""
    group = parser.add_argument_group("SGLang launch-line compatibility (see docs/configuration.md)")
    for f in FLAGS:
        label = {"map": "", _NOOP: "accepted, no effect: ", "refuse": "refused: "}[f.kind]
        help_ = (label + f.why).replace("%", "%%")
        if f.takes_value:
            group.add_argument("--" + f.name, dest=f.dest, default=argparse.SUPPRESS, metavar="VALUE", help=help_)
        else:
            group.add_argument("--" + f.name, dest=f.dest, action="store_true", default=argparse.SUPPRESS,
                               help=help_)
    group.add_argument("--ep", dest=_BY_DEST["sglang_ep_size"].dest, default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
    by_option = {opt: action for action in parser._actions for opt in action.option_strings}
    for alias, name in ALIASES.items():  # SGLang's other spellings of a config field's flag
        if name in by_option and alias not in by_option:
            parser.add_argument(alias, dest=by_option[name].dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    known = {opt for action in parser._actions for opt in action.option_strings}
    for name, nargs in sglang_flags()[1].items():
        if "--" + name in known:
            continue
        kw: dict[str, Any] = {"action": "store_true"} if nargs == 0 else {"nargs": NARGS[nargs], "metavar": "VALUE"}
        parser.add_argument("--" + name, dest=OTHER + name, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)


def _file_backend(out: Overrides) -> str | None:
    """SGLang's ``--hicache-storage-backend file`` (a directory of files): the embedded LMDB store."""
    cache = out.get("cache", {})
    if cache.get("hicache_storage_backend") != "file":
        return None
    cache["hicache_storage_backend"] = "lmdb"
    extra = dict(cache.get("hicache_storage_backend_extra_config") or {})
    path = extra.setdefault("path", os.environ.get(FILE_BACKEND_DIR_ENV, FILE_BACKEND_DIR))
    cache["hicache_storage_backend_extra_config"] = extra
    return f"--hicache-storage-backend file: mapped to the embedded LMDB store at {path}"


def apply(args: argparse.Namespace, out: Overrides) -> list[str]:
    """Apply the SGLang flags given in ``args`` to ``out`` (the config overrides); the lines to log,
    one per flag. ConfigError (one line) for a refused flag."""
    others = sorted(k[len(OTHER):] for k in vars(args) if k.startswith(OTHER))
    if others:
        release = sglang_flags()[0]
        raise ConfigError(f"--{others[0]} (SGLang {release}'s) is not supported here; the SGLang flags that work "
                          "or change nothing are in docs/configuration.md, 'SGLang launch lines'"
                          + (f" (also given: {', '.join('--' + o for o in others[1:])})" if others[1:] else ""))
    notes: list[str] = []
    for dest, f in _BY_DEST.items():
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if f.kind == "refuse":
            if _HARMLESS.get(f.name) == str(value):
                notes.append(f"--{f.name} {value}: accepted, no effect here ({f.why})")
                continue
            raise ConfigError(f"--{f.name} is not supported here: {f.why}")
        if f.kind == _NOOP:
            notes.append(f"--{f.name}: accepted, no effect here: {f.why}")
            continue
        assert f.apply is not None
        note = f.apply(value, out)
        notes.append(f"--{f.name}: {note or f.why}")
    file_note = _file_backend(out)
    if file_note:
        notes.append(file_note)
    return notes
