// Exact integer dot products of the quantized linears, one implementation per ISA (vec.h's
// variants); everything after them is float math in vec.h's lane-wise operations.
//
// Activations (quantize_groups): each row's groups of 32 as 16-bit codes, q = 256 qh + ql with
// qh -127..127 (signed byte) and ql 0..255 (unsigned byte), so byte products carry them exactly.
//
// Block layouts (serving/kernels/cpu_int4.py and cpu_q8.py pack them), per block of 16 output rows
// and group of 32 input channels; a part is the W rows of the 16 that one vector holds:
//   Q4 (int4): 4 chunks of 64 bytes; chunk p byte 4 j + t: row j's code 4 p + t (low nibble, 0..15)
//     and 4 (p + 4) + t (high) -- vpdpbusd's operand layout, one int32 lane per row; part h is
//     bytes 4 W h .. 4 W h + 4 W - 1 of each chunk.
//   Q8 (the head): 16 chunks of 32 bytes; chunk p byte 2 j + t: row j's code 2 p + t (int8,
//     -127..127) -- vpmaddwd's layout once widened to 16 bits; part h is bytes 2 W h .. 2 W h + 2 W - 1.
#pragma once

#include "vec.h"

namespace hv {

#if HV_W > 1
inline IV bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
#if HV_W == 16
  return _mm512_set1_epi32(v);
#else
  return _mm256_set1_epi32(v);
#endif
}
#endif

#if HV_W == 16  // AVX-512 VNNI
// sum c q = 256 sum c qh + sum c ql: vpdpbusd(c, qh) and vpdpbusd(ql, c), both exact in int32.
template <int R>
inline void q4_part(const uint8_t* blk, int /*h*/, const uint8_t* const* ql, const int8_t* const* qh, const int16_t* const*,
                    IV* out) {
  const IV nib = _mm512_set1_epi8(0x0f);
  IV lo_acc[R];
  for (int r = 0; r < R; ++r) out[r] = lo_acc[r] = _mm512_setzero_si512();
  for (int p = 0; p < 4; ++p) {
    const IV v = _mm512_loadu_si512(blk + 64 * p);
    const IV lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    for (int r = 0; r < R; ++r) {
      out[r] = _mm512_dpbusd_epi32(out[r], lo, bcast32(qh[r] + 4 * p));
      out[r] = _mm512_dpbusd_epi32(out[r], hi, bcast32(qh[r] + 4 * p + 16));
      lo_acc[r] = _mm512_dpbusd_epi32(lo_acc[r], bcast32(ql[r] + 4 * p), lo);
      lo_acc[r] = _mm512_dpbusd_epi32(lo_acc[r], bcast32(ql[r] + 4 * p + 16), hi);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_add_epi32(_mm512_slli_epi32(out[r], 8), lo_acc[r]);
}

template <int R>
inline void q8_part(const uint8_t* blk, int /*h*/, const int16_t* const* q, IV* out) {
  for (int r = 0; r < R; ++r) out[r] = _mm512_setzero_si512();
  for (int p = 0; p < 16; ++p) {
    const IV w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * p)));
    for (int r = 0; r < R; ++r) out[r] = _mm512_dpwssd_epi32(out[r], w, bcast32(q[r] + 2 * p));
  }
}
#elif HV_W == 8  // AVX2 (+ AVX-VNNI)
// An accumulator kept a register chain: without it GCC reassociates integer sums (legal for
// integers) into a tree of all the products and spills most of them (no change to the integers).
inline IV keep(IV a) {
  asm("" : "+x"(a));
  return a;
}

template <int R>
inline void q4_part(const uint8_t* blk, int h, const uint8_t* const* ql, const int8_t* const* qh, const int16_t* const*,
                    IV* out) {
  const IV nib = _mm256_set1_epi8(0x0f);
#if defined(__AVXVNNI__)
  IV lo_acc[R];
  for (int r = 0; r < R; ++r) out[r] = lo_acc[r] = _mm256_setzero_si256();
  for (int p = 0; p < 4; ++p) {
    const IV v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * p + 32 * h));
    const IV lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    for (int r = 0; r < R; ++r) {
      out[r] = _mm256_dpbusd_avx_epi32(out[r], lo, bcast32(qh[r] + 4 * p));
      out[r] = _mm256_dpbusd_avx_epi32(out[r], hi, bcast32(qh[r] + 4 * p + 16));
      lo_acc[r] = _mm256_dpbusd_avx_epi32(lo_acc[r], bcast32(ql[r] + 4 * p), lo);
      lo_acc[r] = _mm256_dpbusd_avx_epi32(lo_acc[r], bcast32(ql[r] + 4 * p + 16), hi);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm256_add_epi32(_mm256_slli_epi32(out[r], 8), lo_acc[r]);
#else
  // vpmaddubsw into int16: c * qh pairs |.| <= 2 * 15 * 127, 8 summed stay below 2^15; ql * c pairs
  // <= 2 * 255 * 15, 4 summed -- then widened to int32 (vpmaddwd with ones).
  const IV ones = _mm256_set1_epi16(1);
  IV hi16[R], lo16[R], lo32[R];
  for (int r = 0; r < R; ++r) hi16[r] = lo16[r] = lo32[r] = _mm256_setzero_si256();
  for (int p = 0; p < 4; ++p) {
    const IV v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * p + 32 * h));
    const IV lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    for (int r = 0; r < R; ++r) {
      hi16[r] = keep(_mm256_add_epi16(hi16[r], _mm256_maddubs_epi16(lo, bcast32(qh[r] + 4 * p))));
      hi16[r] = keep(_mm256_add_epi16(hi16[r], _mm256_maddubs_epi16(hi, bcast32(qh[r] + 4 * p + 16))));
      lo16[r] = keep(_mm256_add_epi16(lo16[r], _mm256_maddubs_epi16(bcast32(ql[r] + 4 * p), lo)));
      lo16[r] = keep(_mm256_add_epi16(lo16[r], _mm256_maddubs_epi16(bcast32(ql[r] + 4 * p + 16), hi)));
    }
    if (p & 1) {
      for (int r = 0; r < R; ++r) {
        lo32[r] = _mm256_add_epi32(lo32[r], _mm256_madd_epi16(lo16[r], ones));
        lo16[r] = _mm256_setzero_si256();
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(hi16[r], ones), 8), lo32[r]);
#endif
}

template <int R>
inline void q8_part(const uint8_t* blk, int h, const int16_t* const* q, IV* out) {
  for (int r = 0; r < R; ++r) out[r] = _mm256_setzero_si256();
  for (int p = 0; p < 16; ++p) {
    const IV w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 * p + 16 * h)));
    for (int r = 0; r < R; ++r) {
#if defined(__AVXVNNI__)
      out[r] = _mm256_dpwssd_avx_epi32(out[r], w, bcast32(q[r] + 2 * p));
#else
      out[r] = keep(_mm256_add_epi32(out[r], _mm256_madd_epi16(w, bcast32(q[r] + 2 * p))));
#endif
    }
  }
}
#else  // scalar: part h is row h
template <int R>
inline void q4_part(const uint8_t* blk, int h, const uint8_t* const*, const int8_t* const*, const int16_t* const* q,
                    IV* out) {
  for (int r = 0; r < R; ++r) {
    int32_t s = 0;
    for (int p = 0; p < 4; ++p)
      for (int t = 0; t < 4; ++t) {
        const uint8_t b = blk[64 * p + 4 * h + t];
        s += (b & 15) * q[r][4 * p + t] + (b >> 4) * q[r][4 * p + 16 + t];
      }
    out[r] = s;
  }
}

template <int R>
inline void q8_part(const uint8_t* blk, int h, const int16_t* const* q, IV* out) {
  for (int r = 0; r < R; ++r) {
    int32_t s = 0;
    for (int p = 0; p < 16; ++p)
      for (int t = 0; t < 2; ++t) s += static_cast<int8_t>(blk[32 * p + 2 * h + t]) * q[r][2 * p + t];
    out[r] = s;
  }
}
#endif

constexpr float kQMax = 32512.0f;  // 127 * 256: q = 256 qh + ql with |qh| <= 127

// 16-bit codes of one row's groups of 32: dx = amax / 32512,
// q = clamp(round(x * (dx >= FLT_MIN ? 1 / dx : 0)), -32512, 32512), sx = sum q; and q's bytes.
inline void quantize_groups(const float* x, int64_t K, int16_t* q, uint8_t* ql, int8_t* qh, float* dx, int32_t* sx) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const float* xg = x + g * 32;
    V a = vabs(load(xg));
    for (int i = W; i < 32; i += W) a = vmax(a, vabs(load(xg + i)));
    const float amax = reduce_max(a);
    const float d = amax / kQMax;
    const float id = d >= 1.17549435e-38f ? 1.0f / d : 0.0f;  // 1 / a subnormal is inf: the group counts as zeros
    const V vid = splat(id), lo = splat(-kQMax), hi = splat(kQMax);
    int32_t s = 0;
    for (int i = 0; i < 32; i += W) {
      const IV iq = to_int(vmin(vmax(round_even(mul(load(xg + i), vid)), lo), hi));
#if HV_W == 16  // the same codes by vector truncations (every value fits its type)
      const int64_t k = g * 32 + i;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm512_cvtepi32_epi16(iq));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qh + k), _mm512_cvtepi32_epi8(_mm512_srai_epi32(iq, 8)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ql + k), _mm512_cvtepi32_epi8(_mm512_and_si512(iq, _mm512_set1_epi32(255))));
      s += reduce_add_int(iq);
      continue;
#endif
      int32_t t[W];
      std::memcpy(t, &iq, sizeof(t));
      for (int j = 0; j < W; ++j) {
        const int64_t k = g * 32 + i + j;
        q[k] = static_cast<int16_t>(t[j]);
        qh[k] = static_cast<int8_t>(t[j] >> 8);  // floor: q = 256 qh + ql
        ql[k] = static_cast<uint8_t>(t[j] & 255);
        s += t[j];
      }
    }
    dx[g] = d;
    sx[g] = s;
  }
}

}  // namespace hv
