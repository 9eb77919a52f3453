// int8 W8A8 linear for x86 CPUs with AVX-512 VNNI (serving/kernels/cpu_int8.py; built by cpu_ext.py).
//
// y[m, n] = float(acc[m, n] - zero[m] * wsum[n]) * xs[m] * ws[n], where each activation row is
// quantized on its own (asymmetric, 0..255): xs = max(hi - lo, 1e-12) / 255, zero = -round(lo / xs),
// q = clamp(round(x * (1 / xs)) + zero, 0, 255); acc = sum_k q[k] * w[n, k] in int32 (exact).
// Every float step is one IEEE operation, in the order of the torch reference in cpu_int8.py
// (built with -ffp-contract=off), so both give the same bits; a row's result never depends on the
// other rows of its batch.
#include "ops.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// Quantize one row of K floats into q; return (xs, zero).
std::pair<float, float> quantize_row(const float* x, int64_t K, uint8_t* q) {
  __m512 vlo = _mm512_set1_ps(INFINITY), vhi = _mm512_set1_ps(-INFINITY);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_loadu_ps(x + k);
    vlo = _mm512_min_ps(vlo, v);
    vhi = _mm512_max_ps(vhi, v);
  }
  float lo = _mm512_reduce_min_ps(vlo), hi = _mm512_reduce_max_ps(vhi);
  for (; k < K; ++k) {
    lo = std::min(lo, x[k]);
    hi = std::max(hi, x[k]);
  }
  float xs = std::max(hi - lo, 1e-12f) / 255.0f;
  float zero = -std::nearbyint(lo / xs);
  float r = 1.0f / xs;
  const __m512 vr = _mm512_set1_ps(r), vz = _mm512_set1_ps(zero);
  const __m512 v0 = _mm512_setzero_ps(), v255 = _mm512_set1_ps(255.0f);
  for (k = 0; k + 16 <= K; k += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + k), vr),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, vz), v0), v255);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  for (; k < K; ++k) {
    float v = std::nearbyint(x[k] * r) + zero;
    q[k] = static_cast<uint8_t>(std::min(std::max(v, 0.0f), 255.0f));
  }
  return {xs, zero};
}

inline __m512i load_k(const void* p, int64_t left) {
  if (left >= 64) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi8((~0ULL) >> (64 - left), p);
}

// acc[j] = sum_k q[k] * w[(n + j) * K + k] for j < 4.
inline void dot4(const uint8_t* q, const int8_t* w, int64_t K, int32_t* acc) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; k += 64) {
    const int64_t left = K - k;
    const __m512i xv = load_k(q + k, left);
    a0 = _mm512_dpbusd_epi32(a0, xv, load_k(w + k, left));
    a1 = _mm512_dpbusd_epi32(a1, xv, load_k(w + K + k, left));
    a2 = _mm512_dpbusd_epi32(a2, xv, load_k(w + 2 * K + k, left));
    a3 = _mm512_dpbusd_epi32(a3, xv, load_k(w + 3 * K + k, left));
  }
  acc[0] = _mm512_reduce_add_epi32(a0);
  acc[1] = _mm512_reduce_add_epi32(a1);
  acc[2] = _mm512_reduce_add_epi32(a2);
  acc[3] = _mm512_reduce_add_epi32(a3);
}

inline int32_t dot1(const uint8_t* q, const int8_t* w, int64_t K) {
  __m512i a = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) a = _mm512_dpbusd_epi32(a, load_k(q + k, K - k), load_k(w + k, K - k));
  return _mm512_reduce_add_epi32(a);
}

constexpr int64_t kPrefetchBlocks = 8;

}  // namespace

// x [M, K] float32, w [N, K] int8, wsum [N] int64 (sum of each row's codes), ws [N] float32 -> [M, N] float32
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor wsum, torch::Tensor ws) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8 && w.is_contiguous(), "w must be [N, K] int8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "x and w disagree on K");
  auto y = torch::empty({M, N}, x.options());
  std::vector<uint8_t> q(static_cast<size_t>(M * K));
  std::vector<float> xs(M), zero(M);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    auto sz = quantize_row(xp + m * K, K, q.data() + m * K);
    xs[m] = sz.first;
    zero[m] = sz.second;
  }
  const int8_t* wp = w.data_ptr<int8_t>();
  const int64_t* sp = wsum.data_ptr<int64_t>();
  const float* scp = ws.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + 3) / 4;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K * M));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    int32_t acc[4];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * 4, nb = std::min<int64_t>(4, N - n);
      for (int64_t m = 0; m < M; ++m) {
        const uint8_t* qm = q.data() + m * K;
        if (m == 0 && b + kPrefetchBlocks < b1) {  // the block kPrefetchBlocks ahead, into L2
          const char* ahead = reinterpret_cast<const char*>(wp + (n + 4 * kPrefetchBlocks) * K);
          for (int64_t off = 0; off < 4 * K; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T1);
        }
        if (nb == 4) {
          dot4(qm, wp + n * K, K, acc);
        } else {
          for (int64_t j = 0; j < nb; ++j) acc[j] = dot1(qm, wp + (n + j) * K, K);
        }
        const int64_t z = static_cast<int64_t>(zero[m]);
        for (int64_t j = 0; j < nb; ++j) {
          const float v = static_cast<float>(static_cast<int64_t>(acc[j]) - z * sp[n + j]);
          yp[m * N + n + j] = (v * xs[m]) * scp[n + j];
        }
      }
    }
  });
  return y;
}
