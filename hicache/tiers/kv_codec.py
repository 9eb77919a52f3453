"""Encodings of KV pages in the lower tiers (L2 host memory, L3 storage): raw, fp8, int8.

``raw`` keeps L1's bytes. ``fp8`` (e4m3) and ``int8`` keep one byte per element plus one
scale per (token, kv head, layer, K/V), so a page takes ``(head_dim + 1) / (head_dim *
elem_size)`` of its raw bytes (fp32 L1, head_dim 64: 25 %; bf16: 51 %).

**Idempotence.** A scale is a power of two, ``2**e``, stored as its exponent (one int8).
``e`` is the smallest exponent with ``absmax / 2**e <= qmax`` (qmax 127 for int8, 448 for
e4m3), then canonicalised: if every rounded code fits in ``qmax / 2`` (fp8 rounding can
land exactly on 224) the exponent drops by one and the codes double (exact). So the
largest code of a non-zero row is in ``(qmax / 2, qmax]`` unless ``e`` is the floor
``emin``. Decoding gives ``code * 2**e``, exactly representable in the L1 dtype (``emin``
is chosen so that the code's lowest bit stays above the dtype's smallest subnormal).
Re-encoding such a row finds the same exponent (its absmax is ``max|code| * 2**e``, which
lies in ``(2**(e-1) qmax, 2**e qmax]``) and the same codes: ``encode(decode(encode(x)))``
is ``encode(x)`` byte for byte. A page-level scale would not have this property (it
changes as tokens are added to a partly filled page); per-token scales do.

Because of it, a mode with a lossy lower tier applies the same round trip when KV is
stored into L1 (``round_trip``, called by the attention backend): L1 then holds exactly
the values a lower tier gives back, and an L2/L3 hit equals a recompute bit for bit.

Encoded page layout (one page, the L3 payload and one row of an encoded host pool)::

    codes [2 * layers, page_size, kv_heads, head_dim] (1 byte each) | exps [2 * layers, page_size, kv_heads] int8
"""

from __future__ import annotations

import math

import torch

from hicache.tiers.device import KVLayout


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype pools keep ``dtype`` in for copies: torch on CPU has no ``index_copy`` for
    float8, so an fp8 L1's pages move (and sit in L2) as their uint8 bytes."""
    return torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype


class KVEncoding:
    """How one page of a :class:`KVLayout` is laid out in a lower tier. Stateless."""

    name = "raw"
    code = 0  # recorded in the L3 trailer (0: raw, the format before encodings existed)
    lossy = False

    def page_nbytes(self, layout: KVLayout, page_size: int) -> int:
        return layout.bytes_per_token() * page_size

    def encode_pages(self, kv: torch.Tensor, layout: KVLayout, page_size: int) -> torch.Tensor:
        """``[2L, n, X]`` pages in L1 order -> ``[n, page_nbytes]`` uint8."""
        n = kv.shape[1]
        return kv.transpose(0, 1).contiguous().view(torch.uint8).reshape(n, -1)

    def decode_pages(self, raw: torch.Tensor, layout: KVLayout, page_size: int) -> torch.Tensor:
        """``[n, page_nbytes]`` uint8 -> ``[2L, n, X]`` in :func:`storage_dtype` (a view when possible)."""
        n = raw.shape[0]
        return raw.view(storage_dtype(layout.dtype)).view(n, 2 * layout.num_layers, -1).transpose(0, 1)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., head_dim]`` as this encoding gives it back (raw: itself)."""
        return x


class Pow2ScaledEncoding(KVEncoding):
    """One-byte codes with a power-of-two scale per (token, kv head); see the module docstring."""

    qmax: float = 0.0
    code_lsb: int = 0  # log2 of the code's smallest non-zero magnitude's inverse (fp8 subnormal: 2**-9)
    lossy = True

    def page_nbytes(self, layout: KVLayout, page_size: int) -> int:
        return 2 * layout.num_layers * page_size * layout.num_kv_heads * (layout.head_dim + 1)

    def emin(self, dtype: torch.dtype) -> int:
        fi = torch.finfo(dtype)
        smallest = round(math.log2(fi.smallest_normal) + math.log2(fi.eps))  # smallest subnormal
        return max(-127, smallest + self.code_lsb)

    def _to_codes(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _from_codes(self, c: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def quantize(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., D]`` -> codes ``[..., D]`` (1 byte) and exponents ``[...]`` int8 (canonical)."""
        dtype = dtype or x.dtype
        xf = x.float()
        amax = xf.abs().amax(dim=-1)
        # amax = m * 2**E (m in [0.5, 1)), qmax in [2**(k-1), 2**k): the exponent is E - k or E - k + 1
        _, big = torch.frexp(amax)
        e = big.to(torch.int32) - math.frexp(self.qmax)[1] + 1
        e = torch.where(torch.ldexp(amax, -(e - 1)) <= self.qmax, e - 1, e)  # exact: scaling by 2**k
        e = torch.where(amax > 0, e, self.emin(dtype)).clamp(min=self.emin(dtype), max=127)
        codes = self._to_codes(torch.ldexp(xf, -e.unsqueeze(-1)))
        # canonical: the largest code above qmax / 2 unless e is at its floor (fp8 can round down to it)
        small = (self._from_codes(codes).abs().amax(dim=-1) <= self.qmax / 2) & (e > self.emin(dtype)) & (amax > 0)
        if x.device.type != "cpu" or bool(small.any()):  # on a GPU: no host sync (CUDA graphs capture this)
            e = torch.where(small, e - 1, e)
            codes = self._to_codes(torch.ldexp(xf, -e.unsqueeze(-1)))
        return codes, e.to(torch.int8)

    def dequantize(self, codes: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.ldexp(self._from_codes(codes), exps.to(torch.int32).unsqueeze(-1)).to(dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequantize(*self.quantize(x), x.dtype)

    def encode_pages(self, kv: torch.Tensor, layout: KVLayout, page_size: int) -> torch.Tensor:
        rows, n = kv.shape[:2]
        x = kv.transpose(0, 1).reshape(n, rows, page_size, layout.num_kv_heads, layout.head_dim)
        codes, exps = self.quantize(x, layout.dtype)
        return torch.cat([codes.view(torch.uint8).reshape(n, -1), exps.view(torch.uint8).reshape(n, -1)], dim=1)

    def decode_pages(self, raw: torch.Tensor, layout: KVLayout, page_size: int) -> torch.Tensor:
        n, rows = raw.shape[0], 2 * layout.num_layers
        h, d = layout.num_kv_heads, layout.head_dim
        split = rows * page_size * h * d
        codes = raw[:, :split].reshape(n, rows, page_size, h, d).view(self.code_dtype)
        exps = raw[:, split:].reshape(n, rows, page_size, h).view(torch.int8)
        return self.dequantize(codes, exps, layout.dtype).reshape(n, rows, -1).transpose(0, 1)

    code_dtype: torch.dtype = torch.uint8


class Fp8Encoding(Pow2ScaledEncoding):
    name, code, qmax, code_lsb, code_dtype = "fp8", 1, 448.0, 9, torch.float8_e4m3fn

    def _to_codes(self, y: torch.Tensor) -> torch.Tensor:
        return y.to(torch.float8_e4m3fn)

    def _from_codes(self, c: torch.Tensor) -> torch.Tensor:
        return c.float()


class Int8Encoding(Pow2ScaledEncoding):
    name, code, qmax, code_lsb, code_dtype = "int8", 2, 127.0, 0, torch.int8

    def _to_codes(self, y: torch.Tensor) -> torch.Tensor:
        return torch.round(y).clamp_(-127, 127).to(torch.int8)

    def _from_codes(self, c: torch.Tensor) -> torch.Tensor:
        return c.float()


ENCODINGS: dict[str, KVEncoding] = {e.name: e for e in (KVEncoding(), Fp8Encoding(), Int8Encoding())}
ENCODING_BY_CODE: dict[int, KVEncoding] = {e.code: e for e in ENCODINGS.values()}


def get_encoding(name: str) -> KVEncoding:
    try:
        return ENCODINGS[name]
    except KeyError:
        raise ValueError(f"unknown KV encoding {name!r}; choose from {sorted(ENCODINGS)}") from None


def round_trip_encoding(l1_dtype: torch.dtype, l2: str, l3: str) -> KVEncoding:
    """The one encoding L1's stored KV goes through so that every tier gives back the same
    values (raw when no tier is lossy). Raises ``ValueError`` for modes that cannot be exact:
    two different lossy encodings, or a lossy one under an fp8 L1 (already one byte)."""
    lossy = {n for n in (l2, l3) if get_encoding(n).lossy}
    if len(lossy) > 1:
        raise ValueError(f"hicache_l2_encoding {l2!r} and hicache_l3_encoding {l3!r} are two different lossy "
                         "encodings: a page could not come back from both exactly; use one of them (or raw) for both")
    if lossy and torch.empty((), dtype=l1_dtype).element_size() == 1:
        raise ValueError(f"hicache_l2/l3_encoding {lossy.pop()!r} needs a 16- or 32-bit L1; with an fp8 "
                         "--kv-cache-dtype the lower tiers keep L1's fp8 bytes as they are (raw)")
    return get_encoding(lossy.pop()) if lossy else ENCODINGS["raw"]
