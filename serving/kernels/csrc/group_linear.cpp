// The int4 (Q4_1 weights) and q8 (Q8_0 weights, int4's head) linears over 16-bit activations, for
// every variant of vec.h (serving/kernels/cpu_int4.py, cpu_q8.py; built by cpu_ext.py).
//
// Activations: each row's groups of 32 quantized on their own to 16-bit codes (qdot.h
// quantize_groups). Weights: blocks of 16 output rows x one group (qdot.h's layouts) with
// half-float scales: int4 (GGUF Q4_1) w = d * c + m, codes 0..15; q8 (GGUF Q8_0) w = d * c.
// Per group the integer dot is exact in int32 (qdot.h); then, per output, groups in order:
//   int4: y += dx * (d * float(dot) + m * float(sx));   q8: y += dx * (d * float(dot)).
// Every float step is one IEEE operation (built with -ffp-contract=off), lane-wise, in the order of
// the torch twins: every variant gives the twin's bits, and a row's result never depends on the
// other rows of its batch. Rows are taken kTile at a time per pass over a block's weights, so a
// prefill unpacks the weights once per kTile tokens; int4 batches of kManyRows rows or more take
// many_rows.h's 16-bit products instead (the same bits, faster where many rows share the weights).
#include "ops.h"
#include "many_rows.h"
#include "qdot.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

using namespace hv;

constexpr int64_t kGroup = 32;
constexpr int64_t kRows = 16;
constexpr int64_t kQ4Bytes = 4 * 64 + 2 * kRows * 2;  // codes, d[16], m[16]
constexpr int64_t kQ8Bytes = 8 * 64 + kRows * 2;      // codes, d[16]
constexpr int kTile = W == 8 ? 3 : 4;                 // activation rows per pass over a block (AVX2: 16 registers)
constexpr int64_t kRowTile = 64;                      // activation rows per work item
constexpr int64_t kManyRows = 16;                     // int4 batches from this size take many_rows.h
constexpr int kManyTile = W == 8 ? 3 : 8;             // rows per pass of many_rows.h (AVX2: 16 registers, both halves)
constexpr int64_t kManyRowTile = 96;                  // activation rows per work item there (passes of 6 or 8)

struct Acts {  // the quantized activations of M rows: codes q = 256 qh + ql, scales, code sums
  std::vector<int16_t> q;
  std::vector<int16_t> qq;  // q permuted for many_rows.h (filled for its batches only)
  std::vector<uint8_t> ql;
  std::vector<int8_t> qh;
  std::vector<float> dx;
  std::vector<int32_t> sx;
  int64_t K, G;
};

// permuted: only what many_rows.h reads (qq, dx, sx); else what qdot.h's parts read
Acts quantize(const at::Tensor& x, bool permuted) {
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  const auto n = static_cast<size_t>(M * K), ng = static_cast<size_t>(M * G), nb = permuted ? 0 : n;
  Acts a{std::vector<int16_t>(nb), std::vector<int16_t>(n - nb), std::vector<uint8_t>(nb), std::vector<int8_t>(nb),
         std::vector<float>(ng), std::vector<int32_t>(ng), K, G};
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
#if HV_W > 1
      if (permuted) {
        quantize_permuted(xp + r * K, K, a.qq.data() + r * K, a.dx.data() + r * G, a.sx.data() + r * G);
        continue;
      }
#endif
      quantize_groups(xp + r * K, K, a.q.data() + r * K, a.ql.data() + r * K, a.qh.data() + r * K, a.dx.data() + r * G,
                      a.sx.data() + r * G);
    }
  });
  return a;
}

#if HV_W > 1
template <int R>
void q4_many(const uint8_t* wb, const Acts& a, int64_t row0, float* y, int64_t N) {
#if HV_W == 8
  if constexpr (R <= 4) {
    q4_rows_both<R>(wb, kQ4Bytes, a.G, a.qq.data() + row0 * a.K, a.K, a.dx.data() + row0 * a.G,
                    a.sx.data() + row0 * a.G, y, N);
    return;
  }
#endif
  for (int h = 0; h < 16 / W; ++h)
    q4_rows<R>(wb, kQ4Bytes, a.G, h, a.qq.data() + row0 * a.K, a.K, a.dx.data() + row0 * a.G, a.sx.data() + row0 * a.G,
               y + h * W, N);
}

// rows [r, end) of one block, R at a time and then the rest
void q4_block_many(const uint8_t* wb, const Acts& a, int64_t r, int64_t end, float* yp, int64_t N, int64_t col) {
  for (; r + kManyTile <= end; r += kManyTile) q4_many<kManyTile>(wb, a, r, yp + r * N + col, N);
  switch (end - r) {
    case 7: q4_many<7>(wb, a, r, yp + r * N + col, N); break;
    case 6: q4_many<6>(wb, a, r, yp + r * N + col, N); break;
    case 5: q4_many<5>(wb, a, r, yp + r * N + col, N); break;
    case 4: q4_many<4>(wb, a, r, yp + r * N + col, N); break;
    case 3: q4_many<3>(wb, a, r, yp + r * N + col, N); break;
    case 2: q4_many<2>(wb, a, r, yp + r * N + col, N); break;
    case 1: q4_many<1>(wb, a, r, yp + r * N + col, N); break;
    default: break;
  }
}
#endif

// y[r, 0..15] of one block for R activation rows from row0 (y points at the block's columns).
template <int R, bool kQ4>
void block_rows(const uint8_t* wb, const Acts& a, int64_t row0, float* y, int64_t N) {
  const int64_t G = a.G, K = a.K, bytes = kQ4 ? kQ4Bytes : kQ8Bytes;
  for (int h = 0; h < 16 / W; ++h) {
    V acc[R];
    for (int r = 0; r < R; ++r) acc[r] = splat(0.0f);
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* blk = wb + g * bytes;
      const int16_t* qs[R];
      const uint8_t* ql[R];
      const int8_t* qh[R];
      for (int r = 0; r < R; ++r) {
        const int64_t off = (row0 + r) * K + g * kGroup;
        qs[r] = a.q.data() + off;
        ql[r] = a.ql.data() + off;
        qh[r] = a.qh.data() + off;
      }
      IV dot[R];
      const uint16_t* scales = reinterpret_cast<const uint16_t*>(blk + (kQ4 ? 256 : 512));
      const V d = halves(scales + h * W);
      if constexpr (kQ4) {
        q4_part<R>(blk, h, ql, qh, qs, dot);
        const V m = halves(scales + kRows + h * W);
        for (int r = 0; r < R; ++r) {
          const float sx = static_cast<float>(a.sx[(row0 + r) * G + g]);
          const V t = add(mul(d, to_float(dot[r])), mul(m, splat(sx)));
          acc[r] = add(acc[r], mul(splat(a.dx[(row0 + r) * G + g]), t));
        }
      } else {
        q8_part<R>(blk, h, qs, dot);
        for (int r = 0; r < R; ++r) acc[r] = add(acc[r], mul(splat(a.dx[(row0 + r) * G + g]), mul(d, to_float(dot[r]))));
      }
    }
    for (int r = 0; r < R; ++r) store(y + r * N + h * W, acc[r]);
  }
}

template <bool kQ4>
at::Tensor group_linear(at::Tensor x, const at::Tensor& w, const char* what) {
  const int64_t bytes = kQ4 ? kQ4Bytes : kQ8Bytes;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(2) == bytes, what);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = w.size(0), N = NB * kRows;
  TORCH_CHECK(K == w.size(1) * kGroup, "x and w disagree on K");
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const bool many = kQ4 && W > 1 && M >= kManyRows;
  const Acts a = quantize(x, many);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t rows_per_item = many ? kManyRowTile : kRowTile;
  const int64_t tiles = (M + rows_per_item - 1) / rows_per_item, G = a.G;
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, K * std::min(M, rows_per_item)));
  at::parallel_for(0, tiles * NB, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / NB, b = i % NB, end = std::min(M, (t + 1) * rows_per_item);
      const uint8_t* wb = wp + b * G * bytes;
      int64_t r = t * rows_per_item;
#if HV_W > 1
      if (many) {
        q4_block_many(wb, a, r, end, yp, N, b * kRows);
        continue;
      }
#endif
      for (; r + kTile <= end; r += kTile) block_rows<kTile, kQ4>(wb, a, r, yp + r * N + b * kRows, N);
      for (; r < end; ++r) block_rows<1, kQ4>(wb, a, r, yp + r * N + b * kRows, N);
    }
  });
  return y;
}

}  // namespace

at::Tensor int4_linear(at::Tensor x, at::Tensor w) {
  return group_linear<true>(std::move(x), w, "w must be [N / 16, K / 32, 320] uint8");
}

at::Tensor q8_linear(at::Tensor x, at::Tensor w) {
  return group_linear<false>(std::move(x), w, "w must be [N / 16, K / 32, 544] uint8");
}
