"""The C++ CPU ops (serving/kernels/csrc), one extension per ISA variant, built from the same sources
with torch's extension loader (g++ and ninja) on first use; ``make setup`` builds every variant this
machine can run ahead (``python -m serving.kernels.cpu_ext``) and says which were built.

Variants, best first (``VARIANTS``): ``avx512vnni`` (AVX-512 F/BW/DQ/VL + VNNI), ``avxvnni`` (AVX2 +
FMA + F16C + AVX-VNNI), ``avx2`` (AVX2 + FMA + F16C: llama.cpp's ``vpmaddubsw`` dot products),
``scalar`` (portable C++, any CPU with g++). ``extension()`` is the best one the CPU's flags allow
that builds (logged once, with the reason when none does); ``HICACHE_CPU_KERNELS=0`` turns them off
(every caller then uses its torch-op path), ``HICACHE_CPU_KERNELS=<variant>`` picks one. All variants
compute the same bits as the torch twins (csrc/vec.h): which one runs changes speed, never tokens.

- ``int8_linear``: serving.kernels.cpu_int8 (``--quantization int8``);
- ``int4_linear``, ``q8_linear``: serving.kernels.cpu_int4 / cpu_q8 (``--quantization int4`` and its head);
- ``paged_attention``, ``store_kv``: serving.kernels.attention_cpu (``--attention-backend cpu``);
- ``rope_qk``: serving.kernels.cpu_fused (the model's rotary embedding on CPU);
- ``DecoderStack``, ``rmsnorm``: serving.kernels.cpu_decoder (a model's layers in one call per forward).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from dataclasses import dataclass
from types import ModuleType

log = logging.getLogger(__name__)
_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = ["bindings.cpp", "int8_linear.cpp", "group_linear.cpp", "paged_attention.cpp", "rope_store.cpp",
            "decoder.cpp"]
# -fopenmp: at::parallel_for is OpenMP inside the header; without it the ops run on one thread.
# -ffp-contract=off: each float step one IEEE operation, as the torch twins compute it.
_COMMON = ("-O3", "-ffp-contract=off", "-fopenmp")
_AVX2 = ("-mavx2", "-mfma", "-mf16c")


@dataclass(frozen=True)
class Variant:
    name: str
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags it needs
    cflags: tuple[str, ...]
    x86: bool = True

    def missing(self, flags: set[str]) -> list[str]:
        """The CPU flags this machine lacks for this variant ([]: it can run here)."""
        if self.x86 and platform.machine() not in ("x86_64", "AMD64"):
            return [f"x86-64 (this is {platform.machine()})"]
        return sorted(self.cpu_flags - flags)


VARIANTS = (
    Variant("avx512vnni", frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx2", "fma",
                                     "f16c"}),
            ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", *_AVX2)),
    Variant("avxvnni", frozenset({"avx2", "fma", "f16c", "avx_vnni"}), (*_AVX2, "-mavxvnni")),
    Variant("avx2", frozenset({"avx2", "fma", "f16c"}), _AVX2),
    Variant("scalar", frozenset(), (), x86=False),
)
_lock = threading.Lock()
_built: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}
_ext: ModuleType | None = None
_tried = False
why_not = ""  # why extension() is None (set once decided)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split()[2:])
    except OSError:
        return set()


def runnable() -> list[Variant]:
    """The variants this CPU can run, best first."""
    flags = cpu_flags()
    return [v for v in VARIANTS if not v.missing(flags)]


def _build_dir(name: str) -> str:
    """The variant's build folder, one per source folder: torch keys its cache by the module's name
    and rebuilds whenever the sources' path changes, so two checkouts (a worktree, CI's clone)
    sharing one cache would rebuild each other's build at every switch."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    where = hashlib.sha1(_DIR.encode()).hexdigest()[:10]
    path = os.path.join(root, f"hicache_cpu_{name}-{where}")
    os.makedirs(path, exist_ok=True)
    return path


def build(name: str) -> ModuleType | None:
    """The variant's module (built or loaded from torch's extension cache), or None when it does not
    build (the error logged once, kept in ``build_error``). Does not check the CPU can run it."""
    with _lock:
        if name not in _built:
            v = next(v for v in VARIANTS if v.name == name)
            try:
                from torch.utils.cpp_extension import load

                _built[name] = load(name=f"hicache_cpu_{name}", sources=[os.path.join(_DIR, s) for s in _SOURCES],
                                    extra_cflags=[*_COMMON, *v.cflags], extra_ldflags=["-fopenmp"],
                                    extra_include_paths=[_DIR], build_directory=_build_dir(name), verbose=False)
            except Exception as e:  # noqa: BLE001 - any build failure falls back to the next variant
                _built[name] = None
                _errors[name] = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                log.warning("C++ CPU kernels, variant %s: not built (%s)", name, _errors[name])
        return _built[name]


def build_error(name: str) -> str | None:
    return _errors.get(name)


def _decide() -> tuple[ModuleType | None, str]:
    choice = os.environ.get("HICACHE_CPU_KERNELS", "1")
    if choice == "0":
        return None, "HICACHE_CPU_KERNELS=0"
    names = [v.name for v in VARIANTS]
    if choice not in ("1", *names):
        return None, f"HICACHE_CPU_KERNELS={choice!r} is none of 0, 1, {', '.join(names)}"
    flags = cpu_flags()
    wanted = [v for v in VARIANTS if choice in ("1", v.name)]
    for v in wanted:
        missing = v.missing(flags)
        if missing:
            if choice == v.name:
                return None, f"variant {v.name} needs CPU flags this CPU lacks: {', '.join(missing)}"
            continue
        mod = build(v.name)
        if mod is not None:
            return mod, ""
    return None, "no variant built: " + "; ".join(f"{n}: {e}" for n, e in _errors.items())


def extension() -> ModuleType | None:
    """The module of the variant in use, or None (see the module doc)."""
    global _ext, _tried, why_not
    if _tried:  # the hot path (every projection of every step): no lock once decided
        return _ext
    ext, reason = _decide()
    with _lock:
        if not _tried:  # _tried is set last: a lock-free reader never sees a half state
            _ext, why_not = ext, reason
            if ext is not None:
                log.info("C++ CPU kernels: variant %s (of %s this CPU runs)", ext.variant,
                         ", ".join(v.name for v in runnable()))
            else:
                log.warning("C++ CPU kernels: none (%s); using the torch-op paths", reason)
            _tried = True
    return _ext


def variant() -> str | None:
    """The name of the variant in use (None: the torch-op paths)."""
    ext = extension()
    return None if ext is None else ext.variant


def main() -> None:  # make setup: build every variant this CPU runs, so the first request does not wait for g++
    flags = cpu_flags()
    built, failed, skipped = [], [], []
    for v in VARIANTS:
        missing = v.missing(flags)
        if missing:
            skipped.append(f"{v.name} (needs {', '.join(missing)})")
        elif build(v.name) is not None:
            built.append(v.name)
        else:
            failed.append(f"{v.name} ({build_error(v.name)})")
    print("C++ CPU kernels: built " + (", ".join(built) or "none")
          + (f"; in use: {variant() or 'none (torch-op paths): ' + why_not}")
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; not for this CPU: {', '.join(skipped)}" if skipped else ""))


if __name__ == "__main__":
    main()
