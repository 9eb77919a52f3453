// int4 W4A8 linear for x86 CPUs with AVX-512 VNNI (serving/kernels/cpu_int4.py; built by cpu_ext.py).
//
// Weights: 4-bit codes c in groups of 32 input channels, w = d * c + m per (output row, group),
// d and m half floats (GGUF's Q4_1). Activations: each row's groups of 32 quantized on their own,
// symmetric: dx = amax / 127, q = clamp(round(x * (dx >= FLT_MIN ? 1 / dx : 0)), -127, 127), sx = sum(q).
// Per group: dot = sum c * q in int32 (exact); y += dx * (d * float(dot) + m * float(sx)), groups
// in order. Every float step is one IEEE operation, in the order of the torch reference in
// cpu_int4.py (built with -ffp-contract=off): both give the same bits, and a row's result never
// depends on the other rows of its batch.
//
// Packed layout, per block of 16 output rows and group g (320 bytes, read in order): 4 chunks of
// 64 bytes of codes -- chunk p byte 4 j + t holds row j's code 4 p + t in its low nibble and code
// 4 (p + 4) + t in its high nibble, the operand layout of vpdpbusd -- then d[16] and m[16] (f16).
#include "ops.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRows = 16;
constexpr int64_t kBlockBytes = 4 * 64 + 2 * kRows * 2;

// Quantize the groups of one row: q[K] int8, dx[K/32], sx[K/32].
void quantize_row(const float* x, int64_t K, int8_t* q, float* dx, float* sx) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, sign), _mm512_and_ps(b, sign)));
    const float d = amax / 127.0f;
    const float id = d >= FLT_MIN ? 1.0f / d : 0.0f;  // 1 / a subnormal is inf: such a group counts as zeros
    const __m512 vid = _mm512_set1_ps(id);
    __m512 qa = _mm512_roundscale_ps(_mm512_mul_ps(a, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 qb = _mm512_roundscale_ps(_mm512_mul_ps(b, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    qa = _mm512_min_ps(_mm512_max_ps(qa, lo), hi);
    qb = _mm512_min_ps(_mm512_max_ps(qb, lo), hi);
    const __m512i ia = _mm512_cvtps_epi32(qa), ib = _mm512_cvtps_epi32(qb);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup), _mm512_cvtepi32_epi8(ia));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + g * kGroup + 16), _mm512_cvtepi32_epi8(ib));
    dx[g] = d;
    sx[g] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib)));  // exact: |sum| <= 4064
  }
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The 16 outputs of one row block for one activation row (q, dx, sx of that row).
inline __m512 block_row(const uint8_t* wb, int64_t G, const int8_t* q, const float* dx, const float* sx) {
  const __m512i nib = _mm512_set1_epi8(0x0f);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* blk = wb + g * kBlockBytes;
    const int8_t* qg = q + g * kGroup;
    __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(blk + 64 * p);
      d0 = _mm512_dpbusd_epi32(d0, _mm512_and_si512(v, nib), bcast4(qg + 4 * p));
      d1 = _mm512_dpbusd_epi32(d1, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib), bcast4(qg + 4 * (p + 4)));
    }
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
    const __m512 t = _mm512_add_ps(_mm512_mul_ps(d, dot), _mm512_mul_ps(m, _mm512_set1_ps(sx[g])));
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(dx[g]), t));
  }
  return acc;
}

}  // namespace

// x [M, K] float32, w [N / 16, K / 32, 320] uint8 (the packed layout above) -> [M, N] float32
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(2) == kBlockBytes,
              "w must be [N / 16, K / 32, 320] uint8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = w.size(0), G = w.size(1), N = NB * kRows;
  TORCH_CHECK(K == G * kGroup, "x and w disagree on K");
  auto y = torch::empty({M, N}, x.options());
  std::vector<int8_t> q(static_cast<size_t>(M * K));
  std::vector<float> dx(static_cast<size_t>(M * G)), sx(static_cast<size_t>(M * G));
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) quantize_row(xp + r * K, K, q.data() + r * K, dx.data() + r * G, sx.data() + r * G);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, K * M));
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = wp + b * G * kBlockBytes;
      for (int64_t r = 0; r < M; ++r) {
        _mm512_storeu_ps(yp + r * N + b * kRows, block_row(wb, G, q.data() + r * K, dx.data() + r * G, sx.data() + r * G));
      }
    }
  });
  return y;
}
