"""A GGUF file's metadata and tensor table, read without its vocabulary; tensors dequantized on demand.

``gguf.GGUFReader`` parses every element of every metadata array into Python objects: ~9 s for a
262k-token vocabulary on a 2-core machine, before any tensor is touched. This reader walks the
header with ``struct``, keeps scalars, strings and numeric arrays, stands in a string array by its
length (the tokenizer's arrays are read by transformers' GGUF tokenizer conversion), and maps the
tensor data: 0.05 s for the same file. Dequantization (K-quants, Q4_0/Q5_0/Q8_0, F16, BF16, F32)
is ``gguf.quants.dequantize``.

The layout (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64, metadata
count u64, the metadata (key string, value type u32, value), the tensor table (name, rank u32,
dims u64 fastest-moving first, ggml type u32, offset u64 into the data section), then the data
section at the next ``general.alignment`` boundary (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensor:
    """One tensor: its GGUF name, its shape in torch order and its stored bytes (a read-only view)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    raw: np.ndarray  # uint8, [rows, bytes per row]

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name

    def dequantize(self) -> np.ndarray:
        """The values as float32, shape ``self.shape`` (what llama.cpp computes with)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.raw, GGMLQuantizationType(self.ggml_type))
        return np.ascontiguousarray(values.astype(np.float32, copy=False).reshape(self.shape))


@dataclass(frozen=True)
class GgufFile:
    """``metadata`` (string arrays stand in as their length) and ``tensors`` by GGUF name."""

    path: Path
    metadata: dict[str, object]
    tensors: dict[str, GgufTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])


def read_gguf(path: str | Path) -> GgufFile:
    """Parse ``path``'s header and tensor table; the tensor data stays memory-mapped. ValueError
    naming the file when it is not a GGUF this reads (another format or version, cut short)."""
    path = Path(path)
    try:
        return _read(path)
    except (struct.error, UnicodeDecodeError, KeyError, OSError) as e:
        raise ValueError(f"{path}: cannot read it as a GGUF file ({type(e).__name__}: {e})") from e


def _read(path: Path) -> GgufFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    blob = np.memmap(path, mode="r", dtype=np.uint8)
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"{path} is GGUF v{version}; only v2 and v3 are read")
    pos = 24
    metadata: dict[str, object] = {}
    for _ in range(n_kv):
        key, pos = _string(blob, pos)
        (vtype,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, vtype)
    table = []
    for _ in range(n_tensors):
        name, pos = _string(blob, pos)
        (rank,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{rank}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * rank)
        pos += 4 + 8 * rank + 12
        table.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", 32))  # type: ignore[arg-type]
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = {}
    for name, shape, ggml_type, offset in table:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except ValueError:
            raise ValueError(f"{path}: tensor {name} has ggml type {ggml_type}, unknown to gguf") from None
        row_bytes = shape[-1] // block * block_bytes
        rows = prod(shape[:-1])
        start = data_start + offset
        if start + rows * row_bytes > blob.size:
            raise ValueError(f"{path}: tensor {name} ends past the end of the file (cut short?)")
        raw = blob[start : start + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GgufTensor(name, shape, ggml_type, raw)
    return GgufFile(path, metadata, tensors)


def _string(blob: np.ndarray, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return bytes(blob[pos + 8 : pos + 8 + length]).decode("utf-8"), pos + 8 + length


def _value(blob: np.ndarray, pos: int, vtype: int) -> tuple[object, int]:
    if vtype in _SCALARS:
        fmt = "<" + _SCALARS[vtype]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(blob, pos)
    if vtype != _ARRAY:
        raise ValueError(f"GGUF metadata value type {vtype} is unknown")
    etype, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if etype in _SCALARS:
        fmt = f"<{count}{_SCALARS[etype]}"
        return list(struct.unpack_from(fmt, blob, pos)), pos + struct.calcsize(fmt)
    if etype != _STRING:
        raise ValueError(f"GGUF metadata array of type {etype} is not read")
    for _ in range(count):  # skipped: a vocabulary or merge table, read by the tokenizer conversion
        (length,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + length
    return count, pos
