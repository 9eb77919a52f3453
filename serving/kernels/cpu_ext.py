"""The C++ CPU ops (serving/kernels/csrc): built on first use with torch's extension loader (g++ and
ninja; ``make setup`` builds them ahead: ``python -m serving.kernels.cpu_ext``), for x86 CPUs with
AVX-512 VNNI. ``extension()`` is None elsewhere, when ``HICACHE_CPU_KERNELS=0``, or when the build
fails (logged once); every caller then uses its torch-op path.

- ``int8_linear``: serving.kernels.cpu_int8 (``--quantization int8``);
- ``int4_linear``: serving.kernels.cpu_int4 (``--quantization int4``);
- ``paged_attention``, ``store_kv``: serving.kernels.attention_cpu (``--attention-backend cpu``);
- ``rope_qk``: serving.kernels.cpu_fused (the model's rotary embedding on CPU).
"""

from __future__ import annotations

import logging
import os
import platform
import threading

log = logging.getLogger(__name__)
_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = ["bindings.cpp", "int8_linear.cpp", "int4_linear.cpp", "paged_attention.cpp", "rope_store.cpp"]
# -fopenmp: at::parallel_for is OpenMP inside the header; without it the ops run on one thread.
# -ffp-contract=off: each float step one IEEE operation, as the torch references compute it.
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vnni", "-ffp-contract=off", "-fopenmp"]
_lock = threading.Lock()
_ext: object | None = None
_tried = False


def cpu_supported() -> bool:
    """x86-64 with AVX-512 F/BW/DQ and VNNI (what the sources are compiled for)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return {"avx512f", "avx512bw", "avx512dq", "avx512_vnni"} <= set(flags)


def extension():
    """The built module, or None (see the module doc)."""
    global _ext, _tried
    if _tried:  # the hot path (every projection of every step): no lock once decided
        return _ext
    with _lock:
        if not _tried:  # _tried is set after the attempt: a lock-free reader never sees a half state
            if os.environ.get("HICACHE_CPU_KERNELS", "1") != "0" and cpu_supported():
                try:
                    from torch.utils.cpp_extension import load

                    _ext = load(name="hicache_cpu_ops", sources=[os.path.join(_DIR, s) for s in _SOURCES],
                                extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], extra_include_paths=[_DIR],
                                verbose=False)
                except Exception as e:  # noqa: BLE001 - any build failure falls back to torch ops
                    log.warning("C++ CPU kernels not built (%s); using the torch-op paths", e)
            _tried = True
    return _ext


if __name__ == "__main__":  # make setup: build ahead, so the first request does not wait for g++
    print("C++ CPU kernels:", "built" if extension() is not None else "not available (torch-op paths)")
