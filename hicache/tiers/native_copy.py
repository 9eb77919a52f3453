"""Copy pages and hash them in one GIL-free call: :func:`copy_and_hash` (and :func:`copy_and_hash_segments`,
each source copied into several parts).

A reader thread of the storage tier copies each page from the store into its L2 page and
hashes the copy (the trailer check). Done as two calls per page (numpy's copy, then the
XXH3), every page costs the thread two GIL hand-offs, and with 16 readers the hand-offs,
not the memory, set the pace: measured on the H200 host (16 threads, 256 pages of 2 MiB,
cold map), LMDB's raw read 33 GB/s, copy + hash as two calls 16.7 GB/s, one call per group
of four pages that copies and hashes 27.9 GB/s.

The call is ``hicache_copy_hash_segments`` of ``native/copy_hash.c``: for each page (into one
destination, or several: a whole value of a hybrid SWA model), chunk by chunk,
copy then hash the chunk while it is in the CPU's caches, with xxHash's own streaming
functions (python-xxhash's extension module exports them; their values are exactly
``xxhash.xxh3_64_intdigest``'s). The C file is compiled once per source version with the
system's C compiler (``$CC``, else ``cc``) into ``$HICACHE_NATIVE_DIR`` (default
``~/.cache/hicache/native``); ``make setup`` builds it ahead (``python -m
hicache.tiers.native_copy``). The binding is used only after a self-test at first use; with
no compiler, no exported symbols, a failed self-test or ``HICACHE_NATIVE_COPY=0`` every call
is numpy's copy plus :func:`~hicache.tiers.native_hash.xxh3_64`: the same bytes and values,
more hand-offs. ``NATIVE`` says which one runs (None until first use).

Thread-safe: a pure function; the build runs once, under a lock.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence

import numpy as np
import xxhash

from hicache.tiers.native_hash import xxh3_64

log = logging.getLogger("hicache.storage")
_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "copy_hash.c")
_STATE_FNS = ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset", "XXH3_64bits_update", "XXH3_64bits_digest")
CHUNK = 128 << 10  # copied then hashed while in L2
_lock = threading.Lock()
_bound: tuple | None = None
_tried = False
NATIVE: bool | None = None
error: str | None = None


def _library_path() -> str:
    with open(_SRC, "rb") as f:
        digest = hashlib.sha1(f.read()).hexdigest()[:12]
    root = os.environ.get("HICACHE_NATIVE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hicache", "native")
    return os.path.join(root, f"copy_hash-{digest}-{platform.machine()}.so")


def build() -> str:
    """The compiled library's path (compiled now unless already there). Raises on failure."""
    path = _library_path()
    if os.path.exists(path):
        return path
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        subprocess.run([cc, "-O2", "-shared", "-fPIC", _SRC, "-o", tmp], check=True, capture_output=True, timeout=120)
        os.replace(tmp, path)  # atomic: concurrent builders each leave a whole library
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"{cc} failed: {e.stderr.decode(errors='replace').strip()[-300:]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _bind() -> tuple | None:
    global error
    if os.environ.get("HICACHE_NATIVE_COPY", "1") == "0":
        error = "HICACHE_NATIVE_COPY=0"
        return None
    try:
        from xxhash import _xxhash

        xx = ctypes.CDLL(_xxhash.__file__)
        names = [n + "_dispatch" if n == "XXH3_64bits_update" and hasattr(xx, n + "_dispatch") else n
                 for n in _STATE_FNS]
        fns = (ctypes.c_void_p * 5)(*[ctypes.cast(getattr(xx, n), ctypes.c_void_p).value for n in names])
        lib = ctypes.CDLL(build())
    except (ImportError, OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as e:
        error = str(e) or type(e).__name__
        return None
    fn = lib.hicache_copy_hash_segments
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_size_t] + [ctypes.c_void_p] * 5 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
    bound = (fn, fns)
    rng = np.random.default_rng(26)
    for n in (0, 1, 240, 4097, CHUNK, CHUNK + 3, 3 * CHUNK + 17):
        src = [rng.integers(0, 256, n + 1, dtype=np.uint8)[1:] for _ in range(3)]  # unaligned too
        cut = sorted({0, n // 3, min(n, n // 3 + 1), n})  # one part, or up to three (one of them a byte)
        parts = [[np.zeros(n, np.uint8)]] + [[np.zeros(b - a, np.uint8) for a, b in zip(cut, cut[1:], strict=False)]
                                             for _ in range(2)]
        got = _native(bound, src, parts)
        joined = [np.concatenate([np.zeros(0, np.uint8), *p]) for p in parts]
        if got is None or any(h != xxhash.xxh3_64_intdigest(s) or not np.array_equal(s, j)
                              for h, s, j in zip(got, src, joined, strict=True)):
            error = f"self-test failed at {n} bytes"
            return None
    return bound


def _native(bound: tuple, srcs: Sequence[np.ndarray], parts: Sequence[Sequence[np.ndarray]]) -> list[int] | None:
    fn, fns = bound
    n, flat = len(srcs), [d for p in parts for d in p]
    src = (ctypes.c_void_p * n)(*[s.ctypes.data for s in srcs])
    size = (ctypes.c_size_t * n)(*[s.nbytes for s in srcs])
    nseg = (ctypes.c_size_t * n)(*[len(p) for p in parts])
    dst = (ctypes.c_void_p * max(1, len(flat)))(*[d.ctypes.data for d in flat])
    seg = (ctypes.c_size_t * max(1, len(flat)))(*[d.nbytes for d in flat])
    out = (ctypes.c_uint64 * n)()
    if fn(n, src, size, nseg, dst, seg, CHUNK, out, fns) != 0:
        return None
    return list(out)


def _get() -> tuple | None:
    global _bound, _tried, NATIVE
    if not _tried:
        with _lock:
            if not _tried:
                _bound = _bind()
                NATIVE = _bound is not None
                if _bound is None:
                    log.info("L3 page copies: numpy + xxh3 per page (the one-call copy is off: %s)", error)
                _tried = True
    return _bound


def copy_and_hash(srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray]) -> list[int]:
    """Copy each contiguous uint8 array ``srcs[i]`` into ``dsts[i]`` (same size, writable,
    contiguous) and return the XXH3-64 (seed 0) of every copy, in one GIL-free call when the
    native library is there (see the module docstring)."""
    if len(srcs) != len(dsts):
        raise ValueError(f"{len(srcs)} sources but {len(dsts)} destinations")
    for s, d in zip(srcs, dsts, strict=True):
        if s.nbytes != d.nbytes or not (s.flags.c_contiguous and d.flags.c_contiguous) or not d.flags.writeable:
            raise ValueError("copy_and_hash needs contiguous arrays of equal size and writable destinations")
    return _copy(srcs, [[d] for d in dsts])


def copy_and_hash_segments(srcs: Sequence[np.ndarray], parts: Sequence[Sequence[np.ndarray]]) -> list[int]:
    """Copy each contiguous uint8 array ``srcs[i]``, in order, into the arrays ``parts[i]`` (contiguous,
    writable, their sizes summing to ``srcs[i]``'s) and return the XXH3-64 (seed 0) of every source, in one
    GIL-free call when the native library is there (a value whose parts go to different pages)."""
    if len(srcs) != len(parts):
        raise ValueError(f"{len(srcs)} sources but {len(parts)} lists of parts")
    for s, p in zip(srcs, parts, strict=True):
        if sum(d.nbytes for d in p) != s.nbytes or not s.flags.c_contiguous or \
                not all(d.flags.c_contiguous and d.flags.writeable for d in p):
            raise ValueError("copy_and_hash_segments needs contiguous arrays, writable parts that sum to the source")
    return _copy(srcs, parts)


def _copy(srcs: Sequence[np.ndarray], parts: Sequence[Sequence[np.ndarray]]) -> list[int]:
    bound = _get()
    if bound is not None and srcs:
        got = _native(bound, srcs, parts)
        if got is not None:
            return got
    out = []
    for s, p in zip(srcs, parts, strict=True):
        off = 0
        for d in p:
            np.copyto(d, s[off: off + d.nbytes])
            off += d.nbytes
        out.append(xxh3_64(s))
    return out


if __name__ == "__main__":  # make setup: build ahead and say whether the one-call copy is on
    _get()
    print(f"hicache.tiers.native_copy: {'native (' + _library_path() + ')' if NATIVE else 'numpy: ' + str(error)}")
