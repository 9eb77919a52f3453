"""Keep the C heap's freed memory for the next write (glibc ``mallopt``), set once per process.

Without ``writemap`` LMDB copies each value into malloc'd overflow pages (``mdb_page_malloc``) and
frees them at commit. With glibc's defaults a value of a few MiB is an ``mmap`` of its own, or comes
from a heap top that is trimmed back to the OS after the commit frees it; either way the next
transaction touches fresh pages, and the page faults and zeroing cost as much as the copy and the
write together (this project's CPU: ``put`` 0.7 s per GB, 0.1 s with the memory kept; one environment
wrote 0.74 GB/s, then 1.5 GB/s; bench/l3_write.py has the store's numbers). The same holds for the
write-back's framed page values (Python ``bytes`` of a page each). So the first LMDB store a process
opens raises ``M_MMAP_THRESHOLD`` (values below it come from the heap) and ``M_TRIM_THRESHOLD`` (freed
memory up to it stays mapped, per arena): a process keeps up to ``keep_mb`` of freed heap per writer
thread. ``keep_mb`` 0 leaves the allocator as it is. No-op where the C library has no ``mallopt``
(musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger("hicache.storage")
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_lock = threading.Lock()
_kept_mb = 0


def keep_freed_memory(keep_mb: int) -> bool:
    """Set the thresholds for at least ``keep_mb`` MiB (never lowered by a later, smaller call);
    False when nothing was set (``keep_mb`` 0, no ``mallopt``, or it refused)."""
    global _kept_mb
    with _lock:
        if keep_mb <= _kept_mb:
            return keep_mb > 0
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            mallopt = getattr(libc, "mallopt", None)
        except OSError:
            mallopt = None
        if mallopt is None:
            return False
        ok = bool(mallopt(M_MMAP_THRESHOLD, min(MMAP_THRESHOLD, keep_mb << 20))) and \
            bool(mallopt(M_TRIM_THRESHOLD, keep_mb << 20))
        if ok:
            _kept_mb = keep_mb
            log.info("L3: freed heap memory up to %d MiB per arena is kept for the next writes (mallopt)", keep_mb)
        return ok
