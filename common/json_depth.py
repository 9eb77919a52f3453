"""How deeply a JSON text nests, found before parsing it: Python's ``json`` parser recurses per
level, so a 100k-deep body would raise RecursionError (a 500) where it should be a 400 naming
the limit. The worker (serving/server/http_io.py) and the router (router/bodies.py) both refuse
bodies nested deeper than their ``max_json_depth`` (default :data:`DEFAULT_MAX_DEPTH`).

Pure functions, no HTTP; numpy only.
"""

from __future__ import annotations

import numpy as np

DEFAULT_MAX_DEPTH = 128  # the worker's ServerConfig.max_json_depth and the router's RouterConfig.max_json_depth
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'"[]{}')))  # deleted before the depth scan


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in a JSON text (brackets inside strings do not count).
    A few passes in C and numpy, never a Python loop per byte (8 MB: well under 0.2 s).

    In valid JSON a backslash appears only in strings, where it escapes the next byte; so
    dropping every ``\\\\`` pair, then every ``\\"``, leaves only the quotes that open and close
    strings; a bracket is inside a string when an odd number of quotes precede it."""
    s = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    a = np.frombuffer(s, dtype=np.uint8)
    steps = np.zeros(a.size, dtype=np.int8)
    steps[(a == 0x5B) | (a == 0x7B)] = 1
    steps[(a == 0x5D) | (a == 0x7D)] = -1
    steps[np.bitwise_xor.accumulate(a == 0x22)] = 0  # inside a string
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def too_deep(raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH) -> bool:
    """Whether ``raw`` nests arrays and objects deeper than ``max_depth`` (the scan runs only when
    the text has more than ``max_depth`` opening brackets at all)."""
    return raw.count(b"[") + raw.count(b"{") > max_depth and json_depth(raw) > max_depth
