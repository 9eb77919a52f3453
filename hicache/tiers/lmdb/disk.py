"""The disk under an LMDB store: what ``writemap`` needs of it, and a failed write's cause in words.

``writemap`` (LMDB's ``MDB_WRITEMAP``) makes the data file as large as the map (a sparse file)
and writes pages through a shared mapping. A page whose block the file system cannot allocate
(a full disk) is then no error code but SIGBUS, which kills the process (Python cannot catch
it). The store therefore keeps the map within blocks the file already owns: :func:`allocate`
(``posix_fallocate``) before the map is used or grown, so that a write into the map never needs
a new block, whatever fills the disk later. That holds where preallocated blocks are
overwritten in place (ext4, XFS, tmpfs, ...); on a copy-on-write or log-structured file system
(:data:`COPY_ON_WRITE`) an overwrite takes new blocks however much was allocated, so
:func:`writemap_refusal` says why writemap stays off there.

Without writemap LMDB writes with ``pwrite``: a full disk fails the commit (LMDB reports a short
write as EIO, "Input/output error"); :func:`write_failure` names the cause, ENOSPC, by the file
system's free space.
"""

from __future__ import annotations

import errno
import os
import re

COPY_ON_WRITE = frozenset({"btrfs", "zfs", "bcachefs", "f2fs", "nilfs2"})
NO_SPACE = "no space left on device (ENOSPC)"
SLACK = 1 << 20  # a commit writes branch and freelist pages besides the values: about this much more


def filesystem(path: str) -> str | None:
    """The type of the file system that holds ``path`` (``/proc/self/mountinfo``: the mount
    with the longest mount point above it); None where that cannot be read."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040 is a space
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):  # a later mount on the same point hides the earlier
            best, kind = mount, right.split()[0]
    return kind


def writemap_refusal(path: str) -> str | None:
    """Why the map of a store in ``path`` cannot be kept within allocated blocks (then writemap
    stays off), or None."""
    if not hasattr(os, "posix_fallocate"):
        return "this platform has no posix_fallocate to allocate the map's blocks up front"
    kind = filesystem(path)
    if kind in COPY_ON_WRITE:
        return (f"{path} is on {kind}, a copy-on-write file system: a write into the map may need new blocks "
                "however many were allocated up front")
    return None


def allocate(file: str, nbytes: int) -> OSError | None:
    """Give ``file`` its blocks for ``[0, nbytes)`` (extending it when shorter; what it holds is
    kept). The error when the file system could not (ENOSPC: the disk is full), else None. On a
    failure the file may have grown by what was allocated: never shrunk here, since another
    process's map may already reach that far."""
    try:
        fd = os.open(file, os.O_RDWR)
    except OSError as e:
        return e
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        return e
    finally:
        os.close(fd)
    return None


def free_bytes(path: str) -> int | None:
    """Bytes this process may still write on the file system of ``path`` (root may use the
    blocks reserved for it); None when it cannot be asked."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    return (st.f_bfree if root else st.f_bavail) * st.f_frsize


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def no_space(path: str) -> str:
    """The ENOSPC cause, where, and how much is left."""
    free = free_bytes(path)
    return f"{NO_SPACE} on the file system of {path}" + (f" ({mib(free)} free)" if free is not None else "")


def write_failure(exc: BaseException, path: str, needed: int) -> str:
    """Why a write of about ``needed`` bytes to the store in ``path`` failed, in words: ENOSPC
    when the error says so or the file system has less room than the write needs (LMDB reports
    a short write as EIO), EDQUOT likewise, else the error's own text and the path."""
    code = exc.errno if isinstance(exc, OSError) else None
    text = str(exc)
    if code == errno.EDQUOT or "quota exceeded" in text.lower():
        return f"disk quota exceeded (EDQUOT) for {path}"
    free = free_bytes(path)
    if code == errno.ENOSPC or "no space left" in text.lower() or (free is not None and free < needed + SLACK):
        return no_space(path)
    return f"{text} ({path})"
