"""XXH3-64 of page payloads without the GIL, for the storage tier's reader and writer threads.

python-xxhash holds the GIL while it hashes (a 2 MiB page of the 8B shape: ~50-90 us), so
N reader threads that verify pages take turns on it: measured here, two threads hash no
faster than one, and on a 16-thread read the hashes alone would serialise ~15 ms of every
0.5 GB prompt. A ctypes call drops the GIL for its duration, so :func:`xxh3_64` calls
``XXH3_64bits_dispatch`` (xxHash's own code with its run-time SIMD dispatch: AVX2 /
AVX-512 where the CPU has them) of the C library bundled in python-xxhash's extension
module, whose symbols are exported. The binding is used only if it returns exactly
``xxhash.xxh3_64_intdigest`` on a self-test at import (several sizes, aligned and not); else
-- no such symbol, another build, ``HICACHE_NATIVE_HASH=0`` -- every call is the module's
function: the same values, the GIL held. Small buffers always take the module's function
(a ctypes call costs more than it saves there).

Thread-safe (a pure function). ``NATIVE`` says which one runs.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import xxhash

_SMALL = 64 << 10  # below this the module's call is cheaper than ctypes' argument handling


def _bind():
    if os.environ.get("HICACHE_NATIVE_HASH", "1") == "0":
        return None
    try:
        from xxhash import _xxhash

        lib = ctypes.CDLL(_xxhash.__file__)
        fn = getattr(lib, "XXH3_64bits_dispatch", None) or lib.XXH3_64bits
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    rng = np.random.default_rng(26)
    for n in (0, 1, 63, 240, 241, 4096, 65537, (1 << 20) + 3):
        buf = rng.integers(0, 256, n + 1, dtype=np.uint8)
        for off in (0, 1):
            view = buf[off : off + n]
            if fn(view.ctypes.data, n) != xxhash.xxh3_64_intdigest(view):
                return None
    return fn


_FN = _bind()
NATIVE = _FN is not None


def _address(buf) -> tuple[int, int] | None:
    """(address, nbytes) of a contiguous buffer, or None for one ctypes should not be handed."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            return None
        return buf.ctypes.data, buf.nbytes
    try:
        arr = np.frombuffer(buf, dtype=np.uint8)  # bytes, bytearray, memoryview (read-only too): no copy
    except (TypeError, ValueError):
        return None
    return arr.ctypes.data, arr.nbytes


def xxh3_64(buf) -> int:
    """XXH3-64 (seed 0) of a bytes-like object or contiguous numpy array, as
    ``xxhash.xxh3_64_intdigest`` computes it; large buffers hash with the GIL released."""
    if _FN is not None:
        n = buf.nbytes if isinstance(buf, np.ndarray) else len(memoryview(buf).cast("B"))
        if n >= _SMALL:
            where = _address(buf)
            if where is not None:
                return _FN(where[0], where[1])
    return xxhash.xxh3_64_intdigest(buf)
