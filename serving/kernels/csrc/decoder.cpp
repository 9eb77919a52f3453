// A Llama-family decoder's layers in one C++ call per forward (serving/kernels/cpu_decoder.py):
// per layer, residual add + RMSNorm, the qkv projection (+ bias), RoPE on q and k with k and v
// stored straight into the paged caches, attention over the pages (paged_attention.cpp), o_proj,
// residual add + RMSNorm, gate_up, SiLU(gate) * up, down -- no Python between the ops. A layer may
// have a sliding window (set_window: Mistral), the attention then reads the window's keys only, and
// attention sinks (set_sinks: a logit per q head in the softmax's denominator, GPT-OSS's).
//
// Every step is the same bits on every variant of vec.h: the projections are the ops of
// int8_linear.cpp / group_linear.cpp (or ATen's fp32 linear), RoPE is rope_store.cpp's formula,
// RMSNorm sums squares in 16 lanes then vec.h's fixed tree, SiLU is vec.h's silu_mul. A token's
// result never depends on the other tokens of its batch (each step is per token or per
// (token, kv head)), so prefill, decode and cache hits compute the same KV.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using namespace hv;

enum Kind : int64_t { kF32 = 0, kInt4 = 1, kInt8 = 2, kQ8 = 3 };

struct Linear {
  int64_t kind = kF32;
  std::vector<at::Tensor> w;  // f32: weight; int4 / q8: packed; int8: codes, wsum, scale
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    switch (kind) {
      case kF32:
        return at::linear(x, w[0], bias);
      case kInt4:
        y = int4_linear(x, w[0]);
        break;
      case kInt8:
        y = int8_linear(x, w[0], w[1], w[2]);
        break;
      case kQ8:
        y = q8_linear(x, w[0]);
        break;
      default:
        TORCH_CHECK(false, "unknown linear kind ", kind);
    }
    return bias.has_value() ? y.add_(*bias) : y;
  }
};

struct Layer {
  at::Tensor norm1, norm2;
  Linear qkv, o, gate_up, down;
  int64_t window = 0;  // a sliding window (token t sees its last `window` keys); 0: full attention
  at::Tensor sinks;    // [heads] float32 attention sinks; undefined: none
};

// y = w * (x * r), r = 1 / sqrt(sum(x^2) / K + eps), the sum in 16 lanes then the fixed tree.
void rmsnorm_rows(const float* x, const float* w, float eps, int64_t T, int64_t K, float* y) {
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = x + t * K;
      F16 acc = splat16(0.0f);
      for (int64_t k = 0; k < K; k += 16) {
        const F16 v = load16(xr + k);
        for (int i = 0; i < 16 / W; ++i) acc.p[i] = add(acc.p[i], mul(v.p[i], v.p[i]));
      }
      const float r = 1.0f / std::sqrt(reduce_add16(acc) / static_cast<float>(K) + eps);
      const V vr = splat(r);
      for (int64_t k = 0; k < K; k += W) store(y + t * K + k, mul(load(w + k), mul(load(xr + k), vr)));
    }
  });
}

void add_rows(float* h, const float* d, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store(h + i, add(load(h + i), load(d + i)));
  for (; i < n; ++i) h[i] = h[i] + d[i];
}

}  // namespace

using namespace hv;

struct DecoderStack::Impl {
 public:
  Impl(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, double eps)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), inter_(inter),
        eps_(static_cast<float>(eps)) {
    TORCH_CHECK(hidden % 16 == 0 && inter % 16 == 0 && head_dim % 2 == 0, "hidden and intermediate sizes must be multiples of 16");
    check_attention_shape(heads, kv_heads, head_dim);
  }

  void add_layer(at::Tensor norm1, at::Tensor norm2, int64_t qkv_kind, std::vector<at::Tensor> qkv,
                 c10::optional<at::Tensor> qkv_bias, int64_t o_kind, std::vector<at::Tensor> o,
                 c10::optional<at::Tensor> o_bias, int64_t gu_kind, std::vector<at::Tensor> gu,
                 c10::optional<at::Tensor> gu_bias, int64_t down_kind, std::vector<at::Tensor> down,
                 c10::optional<at::Tensor> down_bias) {
    TORCH_CHECK(norm1.numel() == hidden_ && norm2.numel() == hidden_, "norm weights");
    layers_.push_back(Layer{norm1.contiguous(), norm2.contiguous(), Linear{qkv_kind, std::move(qkv), qkv_bias},
                            Linear{o_kind, std::move(o), o_bias}, Linear{gu_kind, std::move(gu), gu_bias},
                            Linear{down_kind, std::move(down), down_bias}});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  void set_window(int64_t layer, int64_t window) {
    TORCH_CHECK(0 <= layer && layer < num_layers() && window >= 0, "set_window: layer or window out of range");
    layers_[layer].window = window;
  }

  void set_sinks(int64_t layer, at::Tensor sinks) {
    TORCH_CHECK(0 <= layer && layer < num_layers(), "set_sinks: layer out of range");
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.numel() == heads_ && sinks.device().is_cpu(),
                "sinks must be float32 [heads] on the CPU");
    layers_[layer].sinks = sinks.contiguous();
  }

  at::Tensor forward(at::Tensor h, c10::optional<at::Tensor> delta, const std::vector<at::Tensor>& k_caches,
                        const std::vector<at::Tensor>& v_caches, at::Tensor cos, at::Tensor sin,
                        at::Tensor positions, at::Tensor loc, at::Tensor page_table, int64_t page_size,
                        at::Tensor prefix_lens, at::Tensor extend_lens, double scale, int64_t first, int64_t last) {
    TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden_ && h.is_contiguous() && h.scalar_type() == at::kFloat, "h");
    TORCH_CHECK(0 <= first && first < last && last <= num_layers(), "layer range");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers() && v_caches.size() == k_caches.size(), "caches");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim_, "rope tables");
    const int64_t T = h.size(0), H = heads_, KH = kv_heads_, D = head_dim_, qw = H * D, kw = KH * D;
    positions = positions.to(at::kLong).contiguous();
    loc = loc.to(at::kLong).contiguous();
    const Meta meta = make_meta(T, page_table, page_size, prefix_lens, extend_lens);
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* lp = loc.data_ptr<int64_t>();
    const int64_t slots = k_caches[0].numel() / kw, rows = cos.size(0);
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < rows, "position outside the rope table");
      TORCH_CHECK(lp[t] >= 0 && lp[t] < slots, "slot outside the cache");
    }
    for (int64_t s : meta.slots) TORCH_CHECK(s >= 0 && s < slots, "page table outside the cache");
    float* hp = h.data_ptr<float>();
    auto x = at::empty({T, hidden_}, h.options());
    auto q = at::empty({T, H, D}, h.options());
    auto attn = at::empty({T, qw}, h.options());
    at::Tensor d = delta.has_value() ? delta->contiguous() : at::Tensor();
    std::vector<int64_t> lo;  // a sliding window's first key per token, for window lo_window
    int64_t lo_window = 0;
    for (int64_t i = first; i < last; ++i) {
      const Layer& L = layers_[i];
      const at::Tensor& kc = k_caches[i];
      const at::Tensor& vc = v_caches[i];
      TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == at::kFloat &&
                      vc.scalar_type() == at::kFloat && kc.numel() == slots * kw && vc.numel() == kc.numel(),
                  "KV caches must be contiguous float32 [pages, page_size, kv_heads, head_dim]");
      if (d.defined()) add_rows(hp, d.data_ptr<float>(), T * hidden_);
      rmsnorm_rows(hp, L.norm1.data_ptr<float>(), eps_, T, hidden_, x.data_ptr<float>());
      const at::Tensor qkv = L.qkv(x).contiguous();
      TORCH_CHECK(qkv.size(1) == qw + 2 * kw, "qkv width");
      rope_store(qkv.data_ptr<float>(), pos, lp, cos.data_ptr<float>(), sin.data_ptr<float>(), T, q.data_ptr<float>(),
                 kc.data_ptr<float>(), vc.data_ptr<float>());
      const int64_t* klo = nullptr;
      if (L.window > 0) {  // the first key each token sees: max(0, nkeys - window)
        if (lo_window != L.window) {
          lo.resize(meta.nkeys.size());
          for (size_t t = 0; t < lo.size(); ++t) lo[t] = std::max<int64_t>(0, meta.nkeys[t] - L.window);
          lo_window = L.window;
        }
        klo = lo.data();
      }
      attention_rows(q.data_ptr<float>(), T, H, D, kc.data_ptr<float>(), vc.data_ptr<float>(), KH, meta.slots.data(),
                     meta.width, meta.seq.data(), meta.nkeys.data(), klo,
                     L.sinks.defined() ? L.sinks.data_ptr<float>() : nullptr, static_cast<float>(scale),
                     attn.data_ptr<float>());
      d = L.o(attn).contiguous();
      add_rows(hp, d.data_ptr<float>(), T * hidden_);
      rmsnorm_rows(hp, L.norm2.data_ptr<float>(), eps_, T, hidden_, x.data_ptr<float>());
      const at::Tensor gu = L.gate_up(x).contiguous();
      TORCH_CHECK(gu.size(1) == 2 * inter_, "gate_up width");
      auto act = at::empty({T, inter_}, h.options());
      silu_rows(gu.data_ptr<float>(), T, act.data_ptr<float>());
      d = L.down(act).contiguous();
    }
    return d;
  }

 private:
  struct Meta {
    std::vector<int64_t> slots, seq, nkeys;  // slots [B, width]: flat slot of every position
    int64_t width;
  };

  static Meta make_meta(int64_t T, at::Tensor page_table, int64_t ps, at::Tensor prefix_lens,
                        at::Tensor extend_lens) {
    page_table = page_table.to(at::kLong).contiguous();
    prefix_lens = prefix_lens.to(at::kLong).contiguous();
    extend_lens = extend_lens.to(at::kLong).contiguous();
    const int64_t B = page_table.size(0), P = page_table.size(1);
    const int64_t* tab = page_table.data_ptr<int64_t>();
    const int64_t* pre = prefix_lens.data_ptr<int64_t>();
    const int64_t* ext = extend_lens.data_ptr<int64_t>();
    Meta m;
    m.width = 1;
    for (int64_t b = 0; b < B; ++b) m.width = std::max(m.width, pre[b] + ext[b]);
    TORCH_CHECK(m.width <= P * ps, "sequences longer than their page table");
    m.slots.assign(static_cast<size_t>(B * m.width), 0);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t p = 0; p < pre[b] + ext[b]; ++p) m.slots[b * m.width + p] = tab[b * P + p / ps] * ps + p % ps;
      for (int64_t j = 0; j < ext[b]; ++j) {
        m.seq.push_back(b);
        m.nkeys.push_back(pre[b] + j + 1);
      }
    }
    TORCH_CHECK(static_cast<int64_t>(m.seq.size()) == T, "extend_lens do not add up to the tokens");
    return m;
  }

  // q rotated into qo [T, H, D]; k rotated and v copied into the caches' slots loc[t]
  // (x1 c1 + (-x2) s1 and x2 c2 + x1 s2: rope_store.cpp's bits).
  void rope_store(const float* qkv, const int64_t* pos, const int64_t* loc, const float* ct, const float* st, int64_t T,
                  float* qo, float* kc, float* vc) const {
    const int64_t H = heads_, KH = kv_heads_, D = head_dim_, half = D / 2, width = (H + 2 * KH) * D;
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* c = ct + pos[t] * D;
        const float* s = st + pos[t] * D;
        const float* xt = qkv + t * width;
        for (int64_t hh = 0; hh < H + KH; ++hh) {
          const float* xi = xt + hh * D;
          float* oi = hh < H ? qo + (t * H + hh) * D : kc + (loc[t] * KH + hh - H) * D;
          for (int64_t j = 0; j < half; ++j) {
            const float x1 = xi[j], x2 = xi[half + j];
            const float a1 = x1 * c[j], b1 = (-x2) * s[j];
            const float a2 = x2 * c[half + j], b2 = x1 * s[half + j];
            oi[j] = a1 + b1;
            oi[half + j] = a2 + b2;
          }
        }
        std::memcpy(vc + loc[t] * KH * D, xt + (H + KH) * D, static_cast<size_t>(KH * D) * sizeof(float));
      }
    });
  }

  void silu_rows(const float* gu, int64_t T, float* out) const {
    const int64_t I = inter_;
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t j = 0; j < I; j += W) store(out + t * I + j, silu_mul(load(gu + t * 2 * I + j), load(gu + t * 2 * I + I + j)));
    });
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, inter_;
  float eps_;
  std::vector<Layer> layers_;
};

DecoderStack::DecoderStack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                           double eps)
    : impl_(std::make_unique<Impl>(hidden, heads, kv_heads, head_dim, inter, eps)) {}

DecoderStack::~DecoderStack() = default;

void DecoderStack::add_layer(at::Tensor norm1, at::Tensor norm2, int64_t qkv_kind, std::vector<at::Tensor> qkv,
                             std::optional<at::Tensor> qkv_bias, int64_t o_kind, std::vector<at::Tensor> o,
                             std::optional<at::Tensor> o_bias, int64_t gu_kind, std::vector<at::Tensor> gu,
                             std::optional<at::Tensor> gu_bias, int64_t down_kind, std::vector<at::Tensor> down,
                             std::optional<at::Tensor> down_bias) {
  impl_->add_layer(std::move(norm1), std::move(norm2), qkv_kind, std::move(qkv), std::move(qkv_bias), o_kind,
                   std::move(o), std::move(o_bias), gu_kind, std::move(gu), std::move(gu_bias), down_kind,
                   std::move(down), std::move(down_bias));
}

int64_t DecoderStack::num_layers() const { return impl_->num_layers(); }

void DecoderStack::set_window(int64_t layer, int64_t window) { impl_->set_window(layer, window); }

void DecoderStack::set_sinks(int64_t layer, at::Tensor sinks) { impl_->set_sinks(layer, std::move(sinks)); }

at::Tensor DecoderStack::forward(at::Tensor h, std::optional<at::Tensor> delta, const std::vector<at::Tensor>& k_caches,
                                 const std::vector<at::Tensor>& v_caches, at::Tensor cos, at::Tensor sin,
                                 at::Tensor positions, at::Tensor loc, at::Tensor page_table, int64_t page_size,
                                 at::Tensor prefix_lens, at::Tensor extend_lens, double scale, int64_t first,
                                 int64_t last) {
  return impl_->forward(std::move(h), std::move(delta), k_caches, v_caches, std::move(cos), std::move(sin),
                        std::move(positions), std::move(loc), std::move(page_table), page_size, std::move(prefix_lens),
                        std::move(extend_lens), scale, first, last);
}

// y = w * (x * r) per row (the final norm of the fused path)
at::Tensor rmsnorm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 16 == 0, "x must be [T, K] float32, K % 16 == 0");
  x = x.contiguous();
  w = w.contiguous();
  auto y = at::empty_like(x);
  rmsnorm_rows(x.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(eps), x.size(0), x.size(1), y.data_ptr<float>());
  return y;
}
