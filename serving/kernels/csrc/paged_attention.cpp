// Causal GQA attention over paged float32 KV for CPUs with AVX-512 (serving/kernels/attention_cpu.py).
//
// Each (token, kv head) pair is computed on its own, from its query and the keys it may see:
// scores s_j = dot(q, k_j) * scale, p_j = exp(s_j - max s), out = sum_j p_j v_j / sum_j p_j, every
// sum in key order. So a token's output has the same bits in a decode batch, in a prefill chunk
// and alone: prefill and decode compute identical KV for the same token.
#include "ops.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kMaxGroup = 16;  // q heads per kv head
constexpr int kMaxChunks = 16;  // head_dim / 16

// e^x for x <= 0 (x >= -87.3 keeps the result normal; below it the result is flushed to 0).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2, high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);      // low part
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// One (token, kv head): G query heads of D floats at q (stride D), n keys at k_rows[j] / v_rows[j].
void attend(const float* q, int G, int D, const float* k, const float* v, const int64_t* slots, int64_t n,
            int64_t row_stride, float scale, float* out, std::vector<float>& scores) {
  const int chunks = D / 16;
  const int64_t padded = (n + 15) / 16 * 16;
  scores.assign(static_cast<size_t>(G * padded), -INFINITY);
  __m512 qv[kMaxGroup][kMaxChunks];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < chunks; ++c) qv[g][c] = _mm512_loadu_ps(q + g * D + c * 16);
  for (int64_t j = 0; j < n; ++j) {
    const float* kr = k + slots[j] * row_stride;
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], _mm512_loadu_ps(kr));
      for (int c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(qv[g][c], _mm512_loadu_ps(kr + c * 16), acc);
      scores[g * padded + j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  for (int g = 0; g < G; ++g) {
    float* s = scores.data() + g * padded;
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < padded; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < padded; j += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));  // padding: -inf -> 0
      _mm512_storeu_ps(s + j, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    const float inv_sum = 1.0f / _mm512_reduce_add_ps(vsum);
    __m512 acc[kMaxChunks];
    for (int c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m512 pj = _mm512_set1_ps(s[j]);
      const float* vr = v + slots[j] * row_stride;
      for (int c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + c * 16), acc[c]);
    }
    const __m512 is = _mm512_set1_ps(inv_sum);
    for (int c = 0; c < chunks; ++c) _mm512_storeu_ps(out + g * D + c * 16, _mm512_mul_ps(acc[c], is));
  }
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                              torch::Tensor seq, torch::Tensor nkeys, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [T, H, D] float32");
  TORCH_CHECK(k.dim() == 3 && k.scalar_type() == torch::kFloat32 && k.is_contiguous(), "k must be [S, KH, D]");
  TORCH_CHECK(v.sizes() == k.sizes() && v.scalar_type() == torch::kFloat32 && v.is_contiguous(), "v like k");
  q = q.contiguous();
  slots = slots.to(torch::kInt64).contiguous();
  seq = seq.to(torch::kInt64).contiguous();
  nkeys = nkeys.to(torch::kInt64).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KH = k.size(1), L = slots.size(1);
  TORCH_CHECK(k.size(2) == D && D % 16 == 0 && D / 16 <= kMaxChunks, "head_dim must be 16..256, a multiple of 16");
  TORCH_CHECK(H % KH == 0 && H / KH <= kMaxGroup, "q heads must be a multiple of kv heads (at most 16 per kv head)");
  const int G = static_cast<int>(H / KH);
  auto out = torch::empty({T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* seqp = seq.data_ptr<int64_t>();
  const int64_t* np = nkeys.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t work = T * KH;
  int64_t keys = 0;
  for (int64_t t = 0; t < T; ++t) keys += np[t];
  const int64_t grain = std::max<int64_t>(1, work * 4096 / std::max<int64_t>(1, keys * H * D));
  at::parallel_for(0, work, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / KH, h = w % KH, n = np[t];
      TORCH_CHECK(n >= 1 && n <= L, "a token must see 1 to L keys");
      attend(qp + (t * H + h * G) * D, G, static_cast<int>(D), kp + h * D, vp + h * D, sp + seqp[t] * L, n, KH * D,
             static_cast<float>(scale), op + (t * H + h * G) * D, scores);
    }
  });
  return out;
}
