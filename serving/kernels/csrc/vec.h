// The vector type the CPU ops are written in, for the ISA this variant is compiled for
// (serving/kernels/cpu_ext.py builds one extension per variant from the same sources):
//   avx512vnni: W = 16 lanes (AVX-512 F/BW/DQ/VL + VNNI);  avx2, avxvnni: W = 8 (AVX2 + FMA + F16C,
//   AVX-VNNI's vpdpbusd where present);  scalar: W = 1 (portable C++).
// Every float operation here is lane-wise and one IEEE operation per lane (the sources are built
// with -ffp-contract=off; fmadd is one fused rounding everywhere), so a kernel written in these
// gives the same bits on every variant. The one cross-lane float sum (reduce_add16) has one fixed
// tree whatever W is. Integer dot products are exact.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define HV_W 16
#elif defined(__AVX2__)
#define HV_W 8
#else
#define HV_W 1
#endif

namespace hv {

constexpr int W = HV_W;

#if HV_W == 16
using V = __m512;
using IV = __m512i;
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V splat(float x) { return _mm512_set1_ps(x); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V div(V a, V b) { return _mm512_div_ps(a, b); }
inline V select_nonneg(V x, V a, V b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), b, a); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vabs(V a) { return _mm512_abs_ps(a); }
inline V round_even(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V halves(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline V to_float(IV a) { return _mm512_cvtepi32_ps(a); }
inline IV to_int(V a) { return _mm512_cvtps_epi32(a); }  // a holds integers: exact
inline V zero_where_less(V x, V lo, V y) { return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ)), y); }
inline V pow2(V n) {  // 2^n, n integral in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline float reduce_max(V a) { return _mm512_reduce_max_ps(a); }  // exact in any order
inline float reduce_min(V a) { return _mm512_reduce_min_ps(a); }
inline int32_t reduce_add_int(IV a) { return _mm512_reduce_add_epi32(a); }
#elif HV_W == 8
using V = __m256;
using IV = __m256i;
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, V a) { _mm256_storeu_ps(p, a); }
inline V splat(float x) { return _mm256_set1_ps(x); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V div(V a, V b) { return _mm256_div_ps(a, b); }
inline V select_nonneg(V x, V a, V b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ)); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline V vabs(V a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
inline V round_even(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline V to_float(IV a) { return _mm256_cvtepi32_ps(a); }
inline IV to_int(V a) { return _mm256_cvtps_epi32(a); }
inline V zero_where_less(V x, V lo, V y) { return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), y); }
inline V pow2(V n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline float reduce_max(V a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float reduce_min(V a) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
}
inline int32_t reduce_add_int(IV a) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}
#else
using V = float;
using IV = int32_t;
inline V load(const float* p) { return *p; }
inline void store(float* p, V a) { *p = a; }
inline V splat(float x) { return x; }
inline V add(V a, V b) { return a + b; }
inline V sub(V a, V b) { return a - b; }
inline V mul(V a, V b) { return a * b; }
inline V div(V a, V b) { return a / b; }
inline V select_nonneg(V x, V a, V b) { return x >= 0.0f ? a : b; }
inline V fmadd(V a, V b, V c) { return std::fma(a, b, c); }
inline V fnmadd(V a, V b, V c) { return std::fma(-a, b, c); }
inline V vmax(V a, V b) { return a > b ? a : b; }  // the SSE/AVX rule: b unless a > b
inline V vmin(V a, V b) { return a < b ? a : b; }
inline V vabs(V a) { return std::fabs(a); }
inline V round_even(V a) { return std::nearbyint(a); }  // the default rounding mode: to nearest even
inline V halves(const uint16_t* p);
inline V to_float(IV a) { return static_cast<float>(a); }
inline IV to_int(V a) { return static_cast<int32_t>(a); }
inline V zero_where_less(V x, V lo, V y) { return x < lo ? 0.0f : y; }
inline V pow2(V n) {
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}
inline float reduce_max(V a) { return a; }
inline float reduce_min(V a) { return a; }
inline int32_t reduce_add_int(IV a) { return a; }

inline float half_to_float(uint16_t h) {  // exact (every half is a float)
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  uint32_t bits;
  if (e == 0x1f) {
    bits = sign | 0x7f800000 | (m << 13);
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (m << 13);
  } else if (m == 0) {
    bits = sign;
  } else {  // subnormal half: normal float
    const float f = static_cast<float>(m) * (1.0f / 16777216.0f);  // m * 2^-24, exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}
inline V halves(const uint16_t* p) { return half_to_float(*p); }
#endif

// 16 floats as 16 / W vectors: the unit of the attention kernel (head_dim chunks of 16).
struct F16 {
  V p[16 / W];
};
inline F16 load16(const float* x) {
  F16 r;
  for (int i = 0; i < 16 / W; ++i) r.p[i] = load(x + i * W);
  return r;
}
inline void store16(float* x, const F16& a) {
  for (int i = 0; i < 16 / W; ++i) store(x + i * W, a.p[i]);
}
inline F16 splat16(float v) {
  F16 r;
  for (int i = 0; i < 16 / W; ++i) r.p[i] = splat(v);
  return r;
}

// The sum of 16 lanes, one tree on every variant: pairs (i, i + 8), then (i, i + 4), (i, i + 2),
// (0, 1) -- the order of GCC's _mm512_reduce_add_ps.
#if HV_W > 1
inline float reduce_add8(__m256 t8) {  // lanes (i, i + 4), (i, i + 2), (0, 1)
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}
#endif
inline float reduce_add16(const F16& a) {
#if HV_W == 16
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.p[0]), 1));
  return reduce_add8(_mm256_add_ps(_mm512_castps512_ps256(a.p[0]), hi));
#elif HV_W == 8
  return reduce_add8(_mm256_add_ps(a.p[0], a.p[1]));
#else
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a.p[i] + a.p[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  const float a0 = s4[0] + s4[2], a1 = s4[1] + s4[3];
  return a0 + a1;
#endif
}

// silu(g) * u lane-wise: g * sigmoid(g) * u with sigmoid(g) = (g >= 0 ? 1 : e) / (1 + e), e = e^-|g|.
inline V exp_nonpositive(V x);
inline V silu_mul(V g, V u) {
  const V e = exp_nonpositive(sub(splat(0.0f), vabs(g)));
  const V sig = div(select_nonneg(g, splat(1.0f), e), add(splat(1.0f), e));
  return mul(mul(g, sig), u);
}

// e^x lane-wise for x <= 0 (x >= -87.3 keeps the result normal; below it the result is 0):
// a degree-7 polynomial on the remainder after n = round(x / ln 2), times 2^n.
inline V exp_nonpositive(V x) {
  const V lo = splat(-87.3f);
  const V xc = vmax(x, lo);
  const V n = round_even(mul(xc, splat(1.44269504088896341f)));
  V r = fnmadd(n, splat(0.693145751953125f), xc);  // ln 2, high part
  r = fnmadd(n, splat(1.428606765330187e-06f), r);  // low part
  V p = splat(1.0f / 5040.0f);
  p = fmadd(p, r, splat(1.0f / 720.0f));
  p = fmadd(p, r, splat(1.0f / 120.0f));
  p = fmadd(p, r, splat(1.0f / 24.0f));
  p = fmadd(p, r, splat(1.0f / 6.0f));
  p = fmadd(p, r, splat(0.5f));
  p = fmadd(p, r, splat(1.0f));
  p = fmadd(p, r, splat(1.0f));
  return zero_where_less(x, lo, mul(p, pow2(n)));
}

}  // namespace hv
