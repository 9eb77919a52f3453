// The many-row (prefill) paths of the int4 and int8 linears (group_linear.cpp, int8_linear.cpp take
// them for prefill-sized batches): the same integers and the same float steps as their few-row
// paths, so the same bits, computed with 16-bit products (vpmaddwd; vpdpwssd with AVX-VNNI /
// AVX-512 VNNI) where one pass over the weights serves R rows.
//
// int4 (q4_rows):
// The Q4 block's nibbles are widened in registers to 16-bit codes: of a 16-bit lane of chunk p,
// the low byte's low nibble, the high byte's low nibble, the low byte's high nibble and the high
// byte's high nibble are four registers of int16 pairs, one int32 lane per output row:
//   (4p, 4p + 2), (4p + 1, 4p + 3), (16 + 4p, 18 + 4p), (17 + 4p, 19 + 4p)
// (codes of the group; see qdot.h's layout). vpmaddwd (AVX2; vpdpwssd with AVX-VNNI / AVX-512
// VNNI) multiplies each by the same pair of a row's 16-bit activation codes, broadcast from a copy
// of the row permuted into that order (quantize_permuted): the group's dot is an exact int32 sum, the
// same integer the byte products give, and then the epilogue is group_linear.cpp's, step for step.
// Each unpacked register serves R rows, so a pass over the weights serves R tokens for six
// integer ops, where the byte path pays per row twice the multiplies plus int16 widening. On AVX2
// (q4_rows_both) a pass takes both halves of a block, so each broadcast pair of activation codes
// serves two multiplies, and each accumulator stays a register chain (qdot.h keep()).
#pragma once

#include "qdot.h"

namespace hv {

#if HV_W > 1

// qdot.h quantize_groups for this path: the same dx, sx and codes (the same float steps), the
// codes written straight in the pairs' order: index 8 p + 2 u + e holds code
// (u >= 2 ? 16 : 0) + 4 p + (u & 1) + 2 e (and no byte halves: this path does not read them).
inline void quantize_permuted(const float* x, int64_t K, int16_t* qq, float* dx, int32_t* sx) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const float* xg = x + g * 32;
    V a = vabs(load(xg));
    for (int i = W; i < 32; i += W) a = vmax(a, vabs(load(xg + i)));
    const float d = reduce_max(a) / kQMax;
    const float id = d >= 1.17549435e-38f ? 1.0f / d : 0.0f;
    const V vid = splat(id), lo = splat(-kQMax), hi = splat(kQMax);
    int32_t t[32];
    for (int i = 0; i < 32; i += W) {
      const IV iq = to_int(vmin(vmax(round_even(mul(load(xg + i), vid)), lo), hi));
      std::memcpy(t + i, &iq, sizeof(iq));
    }
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) s += t[i];
    int16_t* o = qq + g * 32;
    for (int p = 0; p < 4; ++p)
      for (int u = 0; u < 4; ++u)
        for (int e = 0; e < 2; ++e) o[8 * p + 2 * u + e] = static_cast<int16_t>(t[(u >= 2 ? 16 : 0) + 4 * p + (u & 1) + 2 * e]);
    dx[g] = d;
    sx[g] = s;
  }
}

#if HV_W == 16
inline IV load_bytes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IV and16(IV a, IV b) { return _mm512_and_si512(a, b); }
template <int S>
inline IV srl16(IV a) { return _mm512_srli_epi16(a, S); }
inline IV splat16i(int16_t v) { return _mm512_set1_epi16(v); }
inline IV zero_i() { return _mm512_setzero_si512(); }
inline void store_i(int32_t* p, IV a) { _mm512_storeu_si512(p, a); }
inline IV madd_acc(IV acc, IV w, IV x) { return _mm512_dpwssd_epi32(acc, w, x); }
#else
inline IV load_bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IV and16(IV a, IV b) { return _mm256_and_si256(a, b); }
template <int S>
inline IV srl16(IV a) { return _mm256_srli_epi16(a, S); }
inline IV splat16i(int16_t v) { return _mm256_set1_epi16(v); }
inline IV zero_i() { return _mm256_setzero_si256(); }
inline void store_i(int32_t* p, IV a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a); }
#if defined(__AVXVNNI__)
inline IV madd_acc(IV acc, IV w, IV x) { return _mm256_dpwssd_avx_epi32(acc, w, x); }
#else
inline IV madd_acc(IV acc, IV w, IV x) { return keep(_mm256_add_epi32(acc, _mm256_madd_epi16(w, x))); }  // qdot.h
#endif
#endif

// y[r * N + 0 .. W - 1] for R rows and part h of one block of 16 output rows: blk is the block's
// first group (G groups of `bytes`), qq row 0's permuted codes (rows K apart), dx and sx row 0's
// per-group scales and code sums (rows G apart).
template <int R>
inline void q4_rows(const uint8_t* blk, int64_t bytes, int64_t G, int h, const int16_t* qq, int64_t K, const float* dx,
                    const int32_t* sx, float* y, int64_t N) {
  const IV mask = splat16i(0x000f);
  V out[R];  // y's R rows stay in registers over the groups (the same float steps, in the same order)
  for (int r = 0; r < R; ++r) out[r] = splat(0.0f);
  for (int64_t g = 0; g < G; ++g, blk += bytes) {
    IV acc[R];
    for (int r = 0; r < R; ++r) acc[r] = zero_i();
    const int16_t* qg = qq + g * 32;
    for (int p = 0; p < 4; ++p) {
      const IV v = load_bytes(blk + 64 * p + 4 * W * h);
      const IV w0 = and16(v, mask), w1 = and16(srl16<8>(v), mask);
      for (int r = 0; r < R; ++r) acc[r] = madd_acc(acc[r], w0, bcast32(qg + r * K + 8 * p));
      for (int r = 0; r < R; ++r) acc[r] = madd_acc(acc[r], w1, bcast32(qg + r * K + 8 * p + 2));
      const IV w2 = and16(srl16<4>(v), mask), w3 = srl16<12>(v);
      for (int r = 0; r < R; ++r) acc[r] = madd_acc(acc[r], w2, bcast32(qg + r * K + 8 * p + 4));
      for (int r = 0; r < R; ++r) acc[r] = madd_acc(acc[r], w3, bcast32(qg + r * K + 8 * p + 6));
    }
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + 256);
    const V d = halves(scales + h * W), m = halves(scales + 16 + h * W);
    for (int r = 0; r < R; ++r) {  // group_linear.cpp's epilogue, the same operations in the same order
      const V t = add(mul(d, to_float(acc[r])), mul(m, splat(static_cast<float>(sx[r * G + g]))));
      out[r] = add(out[r], mul(splat(dx[r * G + g]), t));
    }
  }
  for (int r = 0; r < R; ++r) store(y + r * N, out[r]);
}

#if HV_W == 8
// AVX2 / AVX-VNNI: both halves of a block (16 outputs) per pass, so each broadcast activation pair
// serves two multiplies; R rows (AVX2's 16 registers: 2 R accumulators, the two halves' codes, the
// mask and the broadcast). The same integers and the same epilogue as q4_rows, per half.
template <int R>
inline void q4_step(IV* a0, IV* a1, IV c0, IV c1, const int16_t* const* q, int64_t off) {
  for (int r = 0; r < R; ++r) {
    const IV x = bcast32(q[r] + off);
    a0[r] = madd_acc(a0[r], c0, x);
    a1[r] = madd_acc(a1[r], c1, x);
  }
}

template <int R>
inline void q4_rows_both(const uint8_t* blk, int64_t bytes, int64_t G, const int16_t* qq, int64_t K, const float* dx,
                         const int32_t* sx, float* y, int64_t N) {
  const IV mask = splat16i(0x000f);
  const int16_t* q[R];
  for (int r = 0; r < R; ++r) {
    q[r] = qq + r * K;
    store(y + r * N, splat(0.0f));
    store(y + r * N + W, splat(0.0f));
  }
  for (int64_t g = 0; g < G; ++g, blk += bytes) {
    IV a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = zero_i();
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const IV v0 = load_bytes(blk + 64 * p), v1 = load_bytes(blk + 64 * p + 32);
      q4_step<R>(a0, a1, and16(v0, mask), and16(v1, mask), q, 32 * g + 8 * p);
      q4_step<R>(a0, a1, and16(srl16<8>(v0), mask), and16(srl16<8>(v1), mask), q, 32 * g + 8 * p + 2);
      q4_step<R>(a0, a1, and16(srl16<4>(v0), mask), and16(srl16<4>(v1), mask), q, 32 * g + 8 * p + 4);
      q4_step<R>(a0, a1, srl16<12>(v0), srl16<12>(v1), q, 32 * g + 8 * p + 6);
    }
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + 256);
    for (int h = 0; h < 2; ++h) {
      const V d = halves(scales + h * W), m = halves(scales + 16 + h * W);
      for (int r = 0; r < R; ++r) {  // group_linear.cpp's epilogue, the same operations in the same order
        const V t = add(mul(d, to_float(h ? a1[r] : a0[r])), mul(m, splat(static_cast<float>(sx[r * G + g]))));
        store(y + r * N + h * W, add(load(y + r * N + h * W), mul(splat(dx[r * G + g]), t)));
      }
    }
  }
}
#endif

// int8 (i8_rows): a block of 16 output rows widened once to int16 pairs (widen_block: one int32
// lane per output, codes 2 pp and 2 pp + 1 of the row; K padded to even with 0), times pairs of a
// row's activation codes (0..255 as int16, the same padding): acc = sum q w exact in int32, the
// integer int8_linear.cpp's byte products give.
inline void widen_block(const int8_t* w, int64_t K, int64_t rows, int16_t* out) {
  const int64_t K2 = (K + 1) / 2;
  for (int h = 0; h < 16 / W; ++h)
    for (int j = 0; j < W; ++j) {
      const int64_t n = h * W + j;
      int16_t* o = out + h * K2 * 2 * W + 2 * j;
      for (int64_t k = 0; k < 2 * K2; ++k)
        o[(k >> 1) * 2 * W + (k & 1)] = n < rows && k < K ? static_cast<int16_t>(w[n * K + k]) : int16_t{0};
    }
}

// acc[r * 16 + h * W + j] for R rows (q: row 0's int16 codes, rows stride apart) and part h of a widened block
template <int R>
inline void i8_rows(const int16_t* wb, int64_t K2, int h, const int16_t* q, int64_t stride, int32_t* acc) {
  IV a[R];
  for (int r = 0; r < R; ++r) a[r] = zero_i();
  const int16_t* wh = wb + h * K2 * 2 * W;
  for (int64_t pp = 0; pp < K2; ++pp) {
    const IV wv = load_bytes(reinterpret_cast<const uint8_t*>(wh + pp * 2 * W));
    for (int r = 0; r < R; ++r) a[r] = madd_acc(a[r], wv, bcast32(q + r * stride + 2 * pp));
  }
  for (int r = 0; r < R; ++r) store_i(acc + r * 16 + h * W, a[r]);
}

#endif

}  // namespace hv
