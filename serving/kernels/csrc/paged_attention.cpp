// Causal GQA attention over paged float32 KV for every variant of vec.h
// (serving/kernels/attention_cpu.py).
//
// Each (token, kv head) pair is computed on its own, from its query and the keys it may see:
// scores s_j = dot(q, k_j) * scale, p_j = exp(s_j - max s), out = sum_j p_j v_j / sum_j p_j, every
// sum in key order (a dot over head_dim: 16 lanes fused-multiply-added chunk by chunk, then one
// fixed 16-lane tree). So a token's output has the same bits in a decode batch, in a prefill chunk
// and alone -- prefill and decode compute identical KV for the same token -- and on every variant.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace hv;

constexpr int kMaxGroup = 16;   // q heads per kv head
constexpr int kMaxChunks = 16;  // head_dim / 16

inline F16 mul16(const F16& a, const F16& b) {
  F16 r;
  for (int i = 0; i < 16 / W; ++i) r.p[i] = mul(a.p[i], b.p[i]);
  return r;
}
inline F16 fmadd16(const F16& a, const F16& b, const F16& c) {
  F16 r;
  for (int i = 0; i < 16 / W; ++i) r.p[i] = fmadd(a.p[i], b.p[i], c.p[i]);
  return r;
}

// One (token, kv head): G query heads of D floats at q (stride D), n keys at k_rows[j] / v_rows[j].
void attend(const float* q, int G, int D, const float* k, const float* v, const int64_t* slots, int64_t n,
            int64_t row_stride, float scale, float* out, std::vector<float>& scores) {
  const int chunks = D / 16;
  const int64_t padded = (n + 15) / 16 * 16;
  scores.assign(static_cast<size_t>(G * padded), -INFINITY);
  F16 qv[kMaxGroup][kMaxChunks];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < chunks; ++c) qv[g][c] = load16(q + g * D + c * 16);
  for (int64_t j = 0; j < n; ++j) {
    const float* kr = k + slots[j] * row_stride;
    for (int g = 0; g < G; ++g) {
      F16 acc = mul16(qv[g][0], load16(kr));
      for (int c = 1; c < chunks; ++c) acc = fmadd16(qv[g][c], load16(kr + c * 16), acc);
      scores[g * padded + j] = reduce_add16(acc) * scale;
    }
  }
  for (int g = 0; g < G; ++g) {
    float* s = scores.data() + g * padded;
    V vmx = splat(-INFINITY);
    for (int64_t j = 0; j < padded; j += W) vmx = vmax(vmx, load(s + j));
    const V m = splat(reduce_max(vmx));  // exact in any order
    F16 vsum = splat16(0.0f);
    for (int64_t j = 0; j < padded; j += 16) {
      for (int i = 0; i < 16 / W; ++i) {
        const V e = exp_nonpositive(sub(load(s + j + i * W), m));  // padding: -inf -> 0
        store(s + j + i * W, e);
        vsum.p[i] = add(vsum.p[i], e);
      }
    }
    const float inv_sum = 1.0f / reduce_add16(vsum);
    F16 acc[kMaxChunks];
    for (int c = 0; c < chunks; ++c) acc[c] = splat16(0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const F16 pj = splat16(s[j]);
      const float* vr = v + slots[j] * row_stride;
      for (int c = 0; c < chunks; ++c) acc[c] = fmadd16(pj, load16(vr + c * 16), acc[c]);
    }
    const F16 is = splat16(inv_sum);
    for (int c = 0; c < chunks; ++c) store16(out + g * D + c * 16, mul16(acc[c], is));
  }
}

}  // namespace

void attention_rows(const float* q, int64_t T, int64_t H, int64_t D, const float* k, const float* v, int64_t KH,
                    const int64_t* slots, int64_t L, const int64_t* seq, const int64_t* nkeys, float scale, float* out) {
  const int G = static_cast<int>(H / KH);
  const int64_t work = T * KH;
  int64_t keys = 0;
  for (int64_t t = 0; t < T; ++t) keys += nkeys[t];
  const int64_t grain = std::max<int64_t>(1, work * 4096 / std::max<int64_t>(1, keys * H * D));
  at::parallel_for(0, work, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / KH, h = w % KH, n = nkeys[t];
      TORCH_CHECK(n >= 1 && n <= L, "a token must see 1 to L keys");
      attend(q + (t * H + h * G) * D, G, static_cast<int>(D), k + h * D, v + h * D, slots + seq[t] * L, n, KH * D, scale,
             out + (t * H + h * G) * D, scores);
    }
  });
}

void check_attention_shape(int64_t H, int64_t KH, int64_t D) {
  TORCH_CHECK(D % 16 == 0 && D / 16 <= kMaxChunks, "head_dim must be 16..256, a multiple of 16");
  TORCH_CHECK(H % KH == 0 && H / KH <= kMaxGroup, "q heads must be a multiple of kv heads (at most 16 per kv head)");
}

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
  TORCH_CHECK(k.size(2) == D, "q and k disagree on head_dim");
  check_attention_shape(H, KH, D);
  auto out = torch::empty({T, H, D}, q.options());
  attention_rows(q.data_ptr<float>(), T, H, D, k.data_ptr<float>(), v.data_ptr<float>(), KH, slots.data_ptr<int64_t>(), L,
                 seq.data_ptr<int64_t>(), nkeys.data_ptr<int64_t>(), static_cast<float>(scale), out.data_ptr<float>());
  return out;
}
