"""The tensor table of a GGUF file, without parsing its metadata values.

``gguf.GGUFReader`` turns every metadata field into numpy views, the tokenizer's ~49k strings
included, which took ~2.5 s of the int4 load on SmolLM2; the tensors need none of it. This reads
the header (version 2 or 3, little-endian), steps over the key/value section by its lengths, and
maps each tensor's bytes read-only from the file (``np.memmap``). Rows of a block-quantized tensor
come back as raw bytes, ``[rows, bytes per row]``, as GGUFReader gives them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# ggml type -> (elements per block, bytes per block) for the types read here
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34)}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # "Q4_1", ... ("type<N>" for a type not listed in GGML_TYPES)
    shape: tuple[int, ...]  # ggml order: the innermost (input) dimension first
    data: np.ndarray | None  # [rows, bytes per row] uint8 (None for an unlisted type)


class _Cursor:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        vals = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return vals

    def string(self) -> str:
        (n,) = self.take("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos]).decode("utf-8")

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            (n,) = self.take("Q")
            self.pos += n
        elif vtype == _ARRAY:
            item, count = self.take("IQ")
            if item in _SCALAR:
                self.pos += _SCALAR[item] * count
            else:
                for _ in range(count):
                    self.skip_value(item)
        elif vtype in _SCALAR:
            self.pos += _SCALAR[vtype]
        else:
            raise ValueError(f"GGUF: unknown metadata value type {vtype}")


def read_tensors(path: Path) -> list[GGUFTensor]:
    """The tensors of the GGUF file ``path`` (ValueError naming it if it is not one this can read:
    another format, another version, or cut short)."""
    try:
        return _read(path)
    except (struct.error, UnicodeDecodeError, ValueError, OSError, IndexError, RecursionError) as e:
        raise ValueError(f"{path}: cannot read its GGUF tensor table ({e})") from e


def _read(path: Path) -> list[GGUFTensor]:
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw))
    if bytes(raw[:4]) != MAGIC:
        raise ValueError(f"{path}: not a GGUF file")
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("IQQ")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    alignment = 32
    for _ in range(n_kv):
        key = cur.string()
        (vtype,) = cur.take("I")
        if key == "general.alignment" and vtype == _UINT32:
            (alignment,) = cur.take("I")
            if alignment <= 0 or alignment % 8:
                raise ValueError(f"general.alignment {alignment} is not a positive multiple of 8")
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        (ndims,) = cur.take("I")
        if not 1 <= ndims <= 4:
            raise ValueError(f"tensor {name} has {ndims} dimensions")
        shape = cur.take("Q" * ndims)
        ggml_type, offset = cur.take("IQ")
        infos.append((name, shape, ggml_type, offset))
    start = -(-cur.pos // alignment) * alignment
    out = []
    for name, shape, ggml_type, offset in infos:
        if ggml_type not in GGML_TYPES:
            out.append(GGUFTensor(name, f"type{ggml_type}", tuple(shape), None))
            continue
        type_name, block, nbytes = GGML_TYPES[ggml_type]
        row_bytes = shape[0] // block * nbytes
        rows = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        end = start + offset + rows * row_bytes
        if end > raw.size:
            raise ValueError(f"tensor {name} ends at byte {end}, past the file's {raw.size}")
        data = raw[start + offset:end].reshape(rows, row_bytes)
        out.append(GGUFTensor(name, type_name, tuple(shape), data))
    return out
