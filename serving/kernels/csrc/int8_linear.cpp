// int8 W8A8 linear for every variant of vec.h (serving/kernels/cpu_int8.py; built by cpu_ext.py).
//
// y[m, n] = float(acc[m, n] - zero[m] * wsum[n]) * xs[m] * ws[n], where each activation row is
// quantized on its own (asymmetric, 0..255): xs = max(hi - lo, 1e-12) / 255, zero = -round(lo / xs),
// q = clamp(round(x * (1 / xs)) + zero, 0, 255); acc = sum_k q[k] * w[n, k] in int32 (exact; the
// weight codes are -127..127). Every float step is one IEEE operation, in the order of the torch
// reference in cpu_int8.py (built with -ffp-contract=off), so every variant gives its bits; a
// row's result never depends on the other rows of its batch.
//
// The products: vpdpbusd (AVX-512 VNNI, AVX-VNNI) on q and w; AVX2's vpmaddubsw on |q - 128| and w
// with the sign of q - 128 (pairs stay below 2^15), then acc = sum (q - 128) w + 128 wsum.
// AVX2 without VNNI, batches of kManyRows rows or more: many_rows.h's 16-bit products on blocks of
// 16 outputs widened once per chunk of kChunk rows (the same acc, so the same bits).
#include "many_rows.h"
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

using namespace hv;

constexpr int64_t kRowTile = 64;  // activation rows per work item (their codes stay in cache)

struct Row {
  const uint8_t* q;   // codes 0..255
  const int8_t* sq;   // q - 128
  const uint8_t* aq;  // |q - 128|
};

// Quantize one row of K floats into q (and q - 128, |q - 128|); return (xs, zero).
std::pair<float, float> quantize_row(const float* x, int64_t K, uint8_t* q, int8_t* sq, uint8_t* aq) {
  float lo = INFINITY, hi = -INFINITY;
  int64_t k = 0;
  if (K >= W) {
    V vlo = load(x), vhi = vlo;
    for (k = W; k + W <= K; k += W) {
      vlo = vmin(vlo, load(x + k));
      vhi = vmax(vhi, load(x + k));
    }
    lo = reduce_min(vlo);
    hi = reduce_max(vhi);
  }
  for (; k < K; ++k) {
    lo = std::min(lo, x[k]);
    hi = std::max(hi, x[k]);
  }
  const float xs = std::max(hi - lo, 1e-12f) / 255.0f;
  const float zero = -std::nearbyint(lo / xs);
  const V vr = splat(1.0f / xs), vz = splat(zero), v0 = splat(0.0f), v255 = splat(255.0f);
  for (k = 0; k + W <= K; k += W) {
    const IV iq = to_int(vmin(vmax(add(round_even(mul(load(x + k), vr)), vz), v0), v255));
    int32_t t[W];
    std::memcpy(t, &iq, sizeof(t));
    for (int j = 0; j < W; ++j) q[k + j] = static_cast<uint8_t>(t[j]);
  }
  for (; k < K; ++k) {
    const float v = std::nearbyint(x[k] * (1.0f / xs)) + zero;
    q[k] = static_cast<uint8_t>(std::min(std::max(v, 0.0f), 255.0f));
  }
  for (k = 0; sq != nullptr && k < K; ++k) {  // (many_rows.h's path reads q only)
    sq[k] = static_cast<int8_t>(static_cast<int>(q[k]) - 128);
    aq[k] = static_cast<uint8_t>(std::abs(static_cast<int>(q[k]) - 128));
  }
  return {xs, zero};
}

// acc[j] = sum_k q[k] * w[j * K + k] for j < J (exact), J <= 4.
template <int J>
inline void dot(const Row& x, const int8_t* w, int64_t K, const int64_t* wsum, int32_t* acc) {
  int64_t k = 0;
#if HV_W == 16
  IV a[J];
  for (int j = 0; j < J; ++j) a[j] = _mm512_setzero_si512();
  for (; k < K; k += 64) {
    const __mmask64 mask = K - k >= 64 ? ~0ULL : (~0ULL) >> (64 - (K - k));
    const IV xv = _mm512_maskz_loadu_epi8(mask, x.q + k);
    for (int j = 0; j < J; ++j) a[j] = _mm512_dpbusd_epi32(a[j], xv, _mm512_maskz_loadu_epi8(mask, w + j * K + k));
  }
  for (int j = 0; j < J; ++j) acc[j] = reduce_add_int(a[j]);
  (void)wsum;
#elif HV_W == 8
  IV a[J];
  for (int j = 0; j < J; ++j) a[j] = _mm256_setzero_si256();
#if defined(__AVXVNNI__)
  for (; k + 32 <= K; k += 32) {
    const IV xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + k));
    for (int j = 0; j < J; ++j)
      a[j] = _mm256_dpbusd_avx_epi32(a[j], xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k)));
  }
  for (int j = 0; j < J; ++j) acc[j] = reduce_add_int(a[j]);
  (void)wsum;
#else
  const IV ones = _mm256_set1_epi16(1);
  for (; k + 32 <= K; k += 32) {
    const IV av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.aq + k));
    const IV sv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sq + k));
    for (int j = 0; j < J; ++j) {
      const IV s = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k)), sv);
      a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(_mm256_maddubs_epi16(av, s), ones));
    }
  }
  for (int j = 0; j < J; ++j) {  // sum (q - 128) w + 128 sum w
    int32_t tail = 0;
    for (int64_t i = k; i < K; ++i) tail += static_cast<int32_t>(x.sq[i]) * w[j * K + i];
    acc[j] = reduce_add_int(a[j]) + tail + static_cast<int32_t>(128 * wsum[j]);
  }
  return;
#endif
  for (; k < K; ++k)
    for (int j = 0; j < J; ++j) acc[j] += static_cast<int32_t>(x.q[k]) * w[j * K + k];
#else
  (void)wsum;
  for (int j = 0; j < J; ++j) {
    int32_t s = 0;
    for (k = 0; k < K; ++k) s += static_cast<int32_t>(x.q[k]) * w[j * K + k];
    acc[j] = s;
  }
#endif
}

#if HV_W > 1
constexpr int64_t kManyRows = 64;  // batches from this size take many_rows.h
constexpr int64_t kChunk = 240;    // rows per work item of that path (its widened block serves them all)
constexpr int kManyTile = W == 8 ? 6 : 8;

template <int R>
void i8_many(const int16_t* wb, int64_t K2, const int16_t* q, int64_t stride, int32_t* acc) {
  for (int h = 0; h < 16 / W; ++h) i8_rows<R>(wb, K2, h, q, stride, acc);
}

// acc [rows, 16] of rows [0, rows) from q (row 0's int16 codes): kManyTile at a time, then the rest
void i8_block(const int16_t* wb, int64_t K2, const int16_t* q, int64_t stride, int64_t rows, int32_t* acc) {
  int64_t r = 0;
  for (; r + kManyTile <= rows; r += kManyTile) i8_many<kManyTile>(wb, K2, q + r * stride, stride, acc + r * 16);
  for (; r < rows; ++r) i8_many<1>(wb, K2, q + r * stride, stride, acc + r * 16);
}
#endif

}  // namespace

// x [M, K] float32, w [N, K] int8, wsum [N] int64 (sum of each row's codes), ws [N] float32 -> [M, N] float32
at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor wsum, at::Tensor ws) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(), "w must be [N, K] int8");
  TORCH_CHECK(wsum.scalar_type() == at::kLong && ws.scalar_type() == at::kFloat, "wsum int64, ws float32");
  x = x.contiguous();
  wsum = wsum.contiguous();
  ws = ws.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && wsum.numel() == N && ws.numel() == N, "x, w, wsum and ws disagree");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#if HV_W == 8 && !defined(__AVXVNNI__)
  const bool many = M >= kManyRows;
#else  // VNNI keeps the byte path: vpdpbusd does twice the products per op of many_rows.h's vpdpwssd
  const bool many = false;
#endif
#if HV_W == 8 && !defined(__AVXVNNI__)
  const bool parts = !many;  // q - 128 and |q - 128|: only AVX2's vpmaddubsw products read them
#else
  const bool parts = false;
#endif
  std::vector<uint8_t> q(static_cast<size_t>(M * K)), aq(parts ? q.size() : 0);
  std::vector<int8_t> sq(aq.size());
  std::vector<float> xs(M), zero(M);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      auto sz = quantize_row(xp + m * K, K, q.data() + m * K, parts ? sq.data() + m * K : nullptr,
                             parts ? aq.data() + m * K : nullptr);
      xs[m] = sz.first;
      zero[m] = sz.second;
    }
  });
  const int8_t* wp = w.data_ptr<int8_t>();
  const int64_t* sp = wsum.data_ptr<int64_t>();
  const float* scp = ws.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if HV_W > 1
  if (many) {
    const int64_t K2 = (K + 1) / 2, NB = (N + 15) / 16, chunks = (M + kChunk - 1) / kChunk;
    std::vector<int16_t> q16(static_cast<size_t>(M * 2 * K2), 0);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t k = 0; k < K; ++k) q16[m * 2 * K2 + k] = q[m * K + k];
    });
    at::parallel_for(0, chunks * NB, 1, [&](int64_t i0, int64_t i1) {
      std::vector<int16_t> wb(static_cast<size_t>(16 * 2 * K2));
      std::vector<int32_t> acc(static_cast<size_t>(kChunk * 16));
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t c = i / NB, b = i % NB, n = b * 16, nb = std::min<int64_t>(16, N - n);
        const int64_t m0 = c * kChunk, rows = std::min(M, m0 + kChunk) - m0;
        widen_block(wp + n * K, K, nb, wb.data());
        i8_block(wb.data(), K2, q16.data() + m0 * 2 * K2, 2 * K2, rows, acc.data());
        for (int64_t r = 0; r < rows; ++r) {  // the epilogue below, step for step
          const int64_t m = m0 + r, z = static_cast<int64_t>(zero[m]);
          for (int64_t j = 0; j < nb; ++j) {
            const float v = static_cast<float>(static_cast<int64_t>(acc[r * 16 + j]) - z * sp[n + j]);
            yp[m * N + n + j] = (v * xs[m]) * scp[n + j];
          }
        }
      }
    });
    return y;
  }
#endif
  const int64_t blocks = (N + 3) / 4, tiles = (M + kRowTile - 1) / kRowTile;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K * std::min(M, kRowTile)));
  at::parallel_for(0, tiles * blocks, grain, [&](int64_t i0, int64_t i1) {
    int32_t acc[4];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / blocks, b = i % blocks, n = b * 4, nb = std::min<int64_t>(4, N - n);
      const int8_t* wb = wp + n * K;
#if HV_W > 1
      if (t == 0 && i + 8 < i1) {  // the block 8 ahead, into L2 (decode streams the weights once)
        const char* ahead = reinterpret_cast<const char*>(wb + 32 * K);
        for (int64_t off = 0; off < 4 * K; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T1);
      }
#endif
      for (int64_t m = t * kRowTile; m < std::min(M, (t + 1) * kRowTile); ++m) {
        const Row row{q.data() + m * K, parts ? sq.data() + m * K : nullptr, parts ? aq.data() + m * K : nullptr};
        if (nb == 4) {
          dot<4>(row, wb, K, sp + n, acc);
        } else {
          for (int64_t j = 0; j < nb; ++j) dot<1>(row, wb + j * K, K, sp + n + j, acc + j);
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
