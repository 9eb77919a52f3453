"""Value files of an LMDB shard: page values written with ``pwrite`` into slot files, LMDB indexing them.

LMDB copies each value into malloc'd pages inside the write transaction and writes them out at commit:
with the tier's framing, three passes over every byte where the disk needs one (bench/l3_write.py: 0.58-0.66x
the raw write rate of the same disk on a 2-vCPU AMD EPYC, 0.66x on the H200 host). With ``value_files`` a
value of at least ``MIN_BYTES`` goes, inside the same write transaction, into a slot of the shard's file
for its exact size (``values-<size>.dat``, slot ``i`` at byte ``i * size``) by ``pwrite``, and LMDB keeps
the index: ``slots`` key -> (size, slot), ``free`` (size, slot) -> empty for the slots given back, and
``meta`` ``next:<size>`` the first slot never handed out. Before the transaction commits the files written
are ``fdatasync``'d (with ``sync``), so an index entry never names bytes that are not on disk: a crash keeps
what LMDB committed, as before.

Reads map each file read-only, whole (:meth:`ValueFiles.view`: a memoryview into the map, valid while the
caller's read transaction is open, read and copied exactly as LMDB's own values are). A file is made
``slots * size`` long when first opened (sparse: blocks are taken as slots are written), so a map never
reaches past its end; a class holds at most ``capacity // size`` slots (a write that finds none free is
stored inline, in ``data``). A slot given back (a delete, an overwrite, an eviction) may be handed out again
by a later transaction while a reader whose snapshot still names it copies it: the value's trailer (its key
and checksum) tells, and the tier drops the copy as it drops any bad value.

Every process opening the directory reads slotted values whatever its own ``value_files`` says (only writes
follow the option), so servers sharing a store agree.

Threads: :meth:`write` and :meth:`sync` run with the shard's write lock held (one writer); :meth:`view`
from any thread (``_lock`` guards opening a class's file and map, once).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import struct
import threading

from hicache.tiers.base import Buffer

SLOT = struct.Struct(">QQ")  # (size, slot): a ``slots`` value, a ``free`` key
MIN_BYTES = 4096  # smaller values stay inline: a slot of their size saves nothing
Value = tuple  # a value given as its parts (bytes-like each), written in order (StorageBackend.batch_set_parts)


def value_len(value: Buffer | Value) -> int:
    """The bytes of a value, whole or in parts."""
    if isinstance(value, tuple):
        return sum(memoryview(p).nbytes for p in value)
    return len(value)


def punch_hole(fd: int, length: int) -> bool:
    """Free the blocks of ``fd``'s first ``length`` bytes, its size unchanged (``fallocate`` with
    ``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE``); False where that is not supported."""
    libc = _libc()
    if libc is None or length <= 0:
        return False
    return libc.fallocate(fd, 3, ctypes.c_long(0), ctypes.c_long(length)) == 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        return libc
    except (OSError, AttributeError):
        return None


def next_key(size: int) -> bytes:
    """``meta``'s key of the first slot of class ``size`` never handed out."""
    return b"next:" + size.to_bytes(8, "big")


class ValueFiles:
    """The slot files of one shard directory (see the module docstring); ``capacity`` bounds each class."""

    def __init__(self, path: str, capacity: int) -> None:
        self.path = path
        self.capacity = capacity
        self._lock = threading.Lock()
        self._open: dict[int, tuple[int, mmap.mmap | None]] = {}  # size -> (fd, read-only map of the file)
        self._dirty: set[int] = set()  # classes written since the last sync (writer only)

    def slots(self, size: int) -> int:
        """How many slots class ``size`` has."""
        return self.capacity // size

    def file(self, size: int) -> str:
        return os.path.join(self.path, f"values-{size}.dat")

    def _get(self, size: int) -> tuple[int, mmap.mmap | None]:
        got = self._open.get(size)
        if got is not None:
            return got
        with self._lock:
            got = self._open.get(size)
            if got is None:
                length = self.slots(size) * size
                fd = os.open(self.file(size), os.O_RDWR | os.O_CREAT, 0o644)
                if os.fstat(fd).st_size < length:
                    os.ftruncate(fd, length)  # sparse; another process may do the same: same length
                got = (fd, mmap.mmap(fd, length, prot=mmap.PROT_READ) if length else None)
                self._open[size] = got
        return got

    def write(self, size: int, slot: int, value: Buffer | Value) -> None:
        """``value`` (``size`` bytes, whole or its parts in order) into slot ``slot`` (not durable before
        :meth:`sync`): one ``pwritev``, continued where a write came back short."""
        fd, _ = self._get(size)
        views = [memoryview(p).cast("B") for p in (value if isinstance(value, tuple) else (value,))]
        off = slot * size
        while views:
            done = os.pwritev(fd, views, off)
            off += done
            while views and done >= views[0].nbytes:
                done -= views[0].nbytes
                views.pop(0)
            if views and done:
                views[0] = views[0][done:]
        self._dirty.add(size)

    def sync(self) -> None:
        """``fdatasync`` every file written since the last call (before the index commits)."""
        for size in sorted(self._dirty):
            os.fdatasync(self._open[size][0])
        self._dirty.clear()

    def discard(self) -> None:
        """Forget what was written since the last sync (its transaction aborted: the slots stay free)."""
        self._dirty.clear()

    def view(self, size: int, slot: int) -> memoryview:
        """Slot ``slot`` of class ``size`` as a read-only view of the file's map."""
        _, m = self._get(size)
        assert m is not None
        return memoryview(m)[slot * size: (slot + 1) * size]

    def reset(self) -> None:
        """Give every file's blocks back (a cleared store: no index entry names a slot any more) by punching
        holes, the length kept: a reader still copying from a map (any process) reads zeros, which its
        trailer check rejects, never past the end of the file (SIGBUS). Where the file system cannot punch
        holes the blocks stay (reused by later writes)."""
        with self._lock:
            for name in os.listdir(self.path):
                if name.startswith("values-") and name.endswith(".dat"):
                    path = os.path.join(self.path, name)
                    fd = os.open(path, os.O_RDWR)
                    try:
                        punch_hole(fd, os.fstat(fd).st_size)
                    finally:
                        os.close(fd)

    def allocated_bytes(self) -> int:
        """Bytes the files hold on disk (their blocks; sparse files hold only what was written)."""
        total = 0
        for name in os.listdir(self.path):
            if name.startswith("values-") and name.endswith(".dat"):
                try:
                    total += os.stat(os.path.join(self.path, name)).st_blocks * 512
                except OSError:
                    pass
        return total

    def close(self) -> None:
        with self._lock:
            for fd, m in self._open.values():
                if m is not None:
                    try:
                        m.close()
                    except BufferError:  # a caller still holds a view: the map goes with it
                        pass
                os.close(fd)
            self._open.clear()
