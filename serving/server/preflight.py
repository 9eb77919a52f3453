"""What ``hicache serve`` checks before anything loads, beyond the config's values themselves
(those the frozen dataclasses check): what needs the file system or the model's config.json.

Each failure is a :class:`ConfigError` of one line naming the value, what is allowed and the
flag; ``hicache serve`` prints it and exits with status 2, without starting the engine. Checked:

- ``--model-path`` (and ``--tokenizer-path``): a folder with a config.json the loader can read;
- ``--tp-size`` against the model's heads (the rules of serving.parallel.shard.ShardPlan);
- the attention backend against an explicit ``--device``;
- L3 on LMDB: its options, a directory that can be created and written, a capacity its disk has
  room for (hicache.sizing.plan_l3);
- an explicit ``--hicache-size`` against the memory the host can pin (hicache.sizing.plan_l2).

Torch-free (the HTTP process does not import the engine).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from hicache import sizing
from serving.server.config import AppConfig, ConfigError

MODEL_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
LAYER_LISTS = ("layers_block_type", "layer_types", "hybrid_override_pattern")  # serving.models.arch_config._num_layers
MAX_TP = 64


def preflight(cfg: AppConfig) -> None:
    """ConfigError (one line) for the first problem found; see the module docstring."""
    model, cache = cfg.engine.model, cfg.engine.cache
    raw = _model_config(model.model_path)
    if model.tokenizer_path is not None and not Path(model.tokenizer_path).exists():
        raise ConfigError(f"--tokenizer-path {model.tokenizer_path}: no such file or directory")
    _check_tp(model.tp_size, raw, model.model_path)
    _check_attention(model.attention_backend, model.device)
    if cache.storage_enabled:
        _check_storage(cache.hicache_storage_backend, cache.hicache_storage_backend_extra_config)
    if cache.hicache_size > 0:
        try:
            sizing.plan_l2(cache.hicache_ratio, cache.hicache_size, cache.effective_hicache_ratio, 0, 1,
                           share=model.tp_size)
        except sizing.TierSizeError as e:
            raise ConfigError(str(e)) from None


def _model_config(path: str) -> dict[str, Any]:
    folder = Path(path)
    if not folder.is_dir():
        why = "not a directory" if folder.exists() else "no such directory"
        raise ConfigError(f"--model-path {path}: {why} (give a Hugging Face model folder with config.json and "
                          "safetensors; `make setup` creates models/SmolLM2-135M-Instruct)")
    config = folder / "config.json"
    try:
        raw = json.loads(config.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--model-path {path}: no config.json in it (give a Hugging Face model folder)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model-path {path}: cannot read config.json ({e})") from None
    missing = [k for k in MODEL_KEYS if not isinstance(raw.get(k) if isinstance(raw, dict) else None, int)]
    if "num_hidden_layers" in missing and any(isinstance(raw.get(k), (list, str)) and raw.get(k) for k in LAYER_LISTS):
        missing.remove("num_hidden_layers")  # the layer list says it (transformers 5 saves Nemotron-H's so)
    if missing:
        raise ConfigError(f"--model-path {path}: config.json lacks {', '.join(missing)} (not a supported model)")
    return raw


def _tp_fits(size: int, heads: int, kv_heads: int, inter: int) -> str | None:
    """Why ``size`` ranks cannot split this model, or None (serving.parallel.shard.ShardPlan.for_model)."""
    if heads % size:
        return f"does not divide the model's {heads} attention heads"
    if kv_heads % size and size % kv_heads:
        return f"and the model's {kv_heads} kv heads: one must divide the other"
    if inter % size:
        return f"does not divide the model's intermediate size {inter}"
    return None


def _check_tp(size: int, raw: dict[str, Any], path: str) -> None:
    heads, inter = raw["num_attention_heads"], raw["intermediate_size"]
    kv_heads = raw.get("num_key_value_heads") or heads
    why = _tp_fits(size, heads, kv_heads, inter)
    if why is None:
        return
    allowed = [n for n in range(1, MAX_TP + 1) if _tp_fits(n, heads, kv_heads, inter) is None]
    raise ConfigError(f"--tp-size {size} {why} ({path}); allowed: {', '.join(map(str, allowed))}")


def _check_attention(backend: str, device: str) -> None:
    kind = device.partition(":")[0]
    if backend == "triton" and kind == "cpu":
        raise ConfigError("--attention-backend triton needs CUDA, and --device is cpu; allowed on cpu: auto, torch, "
                          "cpu")
    if backend == "cpu" and kind == "cuda":
        raise ConfigError("--attention-backend cpu runs on the CPU, and --device is cuda; allowed on cuda: auto, "
                          "triton, torch")


def _check_storage(backend: str, extra: dict[str, Any]) -> None:
    flag = "--hicache-storage-backend-extra-config"
    if backend != "lmdb":
        return
    from hicache.tiers.lmdb.config import LMDBConfig  # torch-free

    try:
        options = LMDBConfig.from_mapping(extra)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{flag}: {e}") from None
    _check_writable(Path(options.path), flag)
    try:
        sizing.plan_l3(backend, extra)
    except sizing.TierSizeError as e:
        raise ConfigError(str(e)) from None


def _check_writable(path: Path, flag: str) -> None:
    """A file can be written where the L3 directory is or will be: in it if it exists, else in its
    nearest existing ancestor (the store creates it). Nothing is created: a start that fails
    later (a port in use) leaves the file system as it was."""
    try:
        where = path
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir():
            raise NotADirectoryError(20, f"{str(where)!r} is not a directory")
        if not os.access(where, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} path {str(path)!r}: cannot write there ({e.strerror or e}); give a writable "
                          "directory") from None
