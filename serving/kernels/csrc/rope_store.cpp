// Rotary embedding of q and k straight out of the fused qkv projection, and the KV store into
// pages, for float32 on CPU (serving/kernels/cpu_fused.py). Both are exact: rope computes
// x1 * c1 + (-x2) * s1 and x2 * c2 + x1 * s2 as separate IEEE products and one add (no FMA), the
// bits of serving/models/rope.py's apply_rope; the store copies.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

at::Tensor rope_qk(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                      int64_t heads, int64_t kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat, "qkv must be [T, W] float32");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "tables");
  TORCH_CHECK(head_dim % 2 == 0 && cos.size(1) == head_dim, "head_dim");
  qkv = qkv.contiguous();
  positions = positions.to(at::kLong).contiguous();
  const int64_t T = qkv.size(0), W = qkv.size(1), n = heads + kv_heads, half = head_dim / 2;
  TORCH_CHECK(W >= n * head_dim, "qkv too narrow");
  auto out = at::empty({T, n, head_dim}, qkv.options());
  const float* x = qkv.data_ptr<float>();
  const float* ct = cos.data_ptr<float>();
  const float* st = sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t rows = cos.size(0);
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < rows, "position outside the rope table");
      const float* c = ct + pos[t] * head_dim;
      const float* s = st + pos[t] * head_dim;
      for (int64_t h = 0; h < n; ++h) {
        const float* xi = x + t * W + h * head_dim;
        float* oi = o + (t * n + h) * head_dim;
        for (int64_t d = 0; d < half; ++d) {
          const float x1 = xi[d], x2 = xi[half + d];
          const float a1 = x1 * c[d], b1 = (-x2) * s[d];
          const float a2 = x2 * c[half + d], b2 = x1 * s[half + d];
          oi[d] = a1 + b1;
          oi[half + d] = a2 + b2;
        }
      }
    }
  });
  return out;
}

void store_kv(at::Tensor k_cache, at::Tensor v_cache, at::Tensor loc, at::Tensor k, at::Tensor v) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(), "dtypes");
  k = k.contiguous();
  v = v.contiguous();
  loc = loc.to(at::kLong).contiguous();
  const int64_t T = loc.size(0), row = k.numel() / std::max<int64_t>(1, T) * k.element_size();
  const int64_t slots = k_cache.numel() * k_cache.element_size() / std::max<int64_t>(1, row);
  TORCH_CHECK(v.numel() == k.numel() && k_cache.numel() == v_cache.numel(), "k and v disagree");
  const int64_t* lp = loc.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(lp[t] >= 0 && lp[t] < slots, "slot outside the cache");
    std::memcpy(kc + lp[t] * row, kp + t * row, row);
    std::memcpy(vc + lp[t] * row, vp + t * row, row);
  }
}
