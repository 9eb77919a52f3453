"""Shared benchmark plumbing: a table printer, the --json convention, and a disk's raw write rate."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

RAW_CHUNK = 8 << 20  # bytes per os.write of raw_write


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    return p


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


def raw_write(work: str, nbytes: int, files: int, sync: bool, every: int = 0) -> float:
    """Seconds for ``files`` threads to write ``nbytes`` in all, sequentially, one file each
    (with ``sync``: ``fdatasync`` at the end, and after every ``every`` bytes when given)."""
    buf = np.random.default_rng(1).integers(0, 255, RAW_CHUNK, dtype=np.uint8).tobytes()
    share = nbytes // files
    paths = [os.path.join(work, f"raw-{i}") for i in range(files)]

    def one(path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left, since = share, 0
            while left > 0:
                n = os.write(fd, buf[: min(RAW_CHUNK, left)])
                left, since = left - n, since + n
                if sync and every and since >= every:
                    os.fdatasync(fd)
                    since = 0
            if sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    ts = [threading.Thread(target=one, args=(p,)) for p in paths]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    for p in paths:
        os.unlink(p)
    return dt


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
