// Causal GQA attention over paged float32 KV for every variant of vec.h
// (serving/kernels/attention_cpu.py); with klo, a sliding window: token t sees keys klo[t] .. nkeys[t] - 1;
// with sinks, GPT-OSS's attention sinks: q head h's sinks[h] joins each softmax's max and denominator.
//
// Each (token, query head) is computed from its query and the keys it may see: scores
// s_j = dot(q, k_j) * scale, p_j = exp(s_j - max s), out = sum_j p_j v_j / sum_j p_j, every sum in
// key order (a dot over head_dim: 16 lanes fused-multiply-added chunk by chunk, then one fixed
// 16-lane tree). So a token's output has the same bits in a decode batch, in a prefill chunk and
// alone -- prefill and decode compute identical KV for the same token -- and on every variant. A
// sink: m = max(sink, max s), sum p = e^(sink - m) + (the keys' sum), the exponential vec.h's lanes'.
//
// Speed without changing a bit: a work item is up to kRows consecutive tokens of one sequence and
// one kv head, so every key and value row is loaded once for all of them (a verify pass of k + 1
// tokens, or a prefill chunk, reads the KV once, not once per token); scores are made 16 keys at a
// time, their 16 trees summed together by shuffles (reduce_block: each key's tree is vec.h's
// reduce_add16, operand for operand) instead of one horizontal sum per key.
#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using namespace hv;

constexpr int kMaxGroup = 16;     // q heads per kv head
constexpr int kMaxChunks = 16;    // head_dim / 16
constexpr int kBlock = 16;        // keys per score block
constexpr int64_t kRows = 16;     // tokens of one sequence per work item (they share each K / V load)
constexpr int64_t kVChunk = 64;   // keys per pass of the value sums (in L1 while every query reads them)

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

// s[i] = reduce_add16(a[i]) * scale for the 16 sums of a key block: vec.h's tree for each --
// (i, i + 8), (i, i + 4), (i, i + 2), (0, 1), the same operands in the same order -- with the pairs
// of W keys added in one vector (shuffles gather them), then the lanes put back in key order.
inline void reduce_block(const F16* a, float scale, float* s) {
#if HV_W == 16
  __m512 v[8], w[4], x[2];
  for (int m = 0; m < 8; ++m) {  // lanes 0..7: key 2m's (i, i + 8) sums, 8..15: key 2m + 1's
    const __m512 p = a[2 * m].p[0], q = a[2 * m + 1].p[0];
    v[m] = _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x44), _mm512_shuffle_f32x4(p, q, 0xEE));
  }
  for (int n = 0; n < 4; ++n)  // quarter i: key 4n + i's (i, i + 4) sums
    w[n] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * n], v[2 * n + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * n], v[2 * n + 1], 0xDD));
  for (int r = 0; r < 2; ++r)  // quarter i: (i, i + 2) sums of keys 8r + i, 8r + 4 + i
    x[r] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * r], w[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * r], w[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));  // lane 4i + c: key 4c + i
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  store(s, mul(_mm512_permutexvar_ps(order, y), splat(scale)));
#elif HV_W == 8
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int b = 0; b < 16; b += 8) {
    __m256 t[8], v[4], x[2];
    for (int j = 0; j < 8; ++j) t[j] = _mm256_add_ps(a[b + j].p[0], a[b + j].p[1]);  // (i, i + 8)
    for (int m = 0; m < 4; ++m)  // half 0: key 2m's (i, i + 4) sums, half 1: key 2m + 1's
      v[m] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * m], t[2 * m + 1], 0x20),
                           _mm256_permute2f128_ps(t[2 * m], t[2 * m + 1], 0x31));
    for (int r = 0; r < 2; ++r)  // half i: (i, i + 2) sums of keys 4r + i, 4r + 2 + i
      x[r] = _mm256_add_ps(_mm256_shuffle_ps(v[2 * r], v[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(v[2 * r], v[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 y = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));  // lane 4i + c: key 2c + i
    store(s + b, mul(_mm256_permutevar8x32_ps(y, order), splat(scale)));
  }
#else
  for (int i = 0; i < 16; ++i) s[i] = reduce_add16(a[i]) * scale;
#endif
}

// acc_q += sum_{j0 <= j < je} p_qj v_j in key order for Q queries (scores s + q * ps, sums at
// acc + q * D): Q * chunks independent chains, each value row loaded once for all Q.
template <int kChunks, int Q>
inline void value_sums(const float* s, int64_t ps, float* acc, int64_t D, int64_t j0, int64_t je, const int64_t* sl,
                       const float* v, int64_t stride, int chunks) {
  constexpr int kC = kChunks > 0 ? kChunks : kMaxChunks;
  F16 a[Q][kC];
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < chunks; ++c) a[q][c] = load16(acc + q * D + c * 16);
  for (int64_t j = j0; j < je; ++j) {
    const float* vr = v + sl[j] * stride;
    for (int c = 0; c < chunks; ++c) {
      const F16 vc = load16(vr + c * 16);
      for (int q = 0; q < Q; ++q) a[q][c] = fmadd16(splat16(s[q * ps + j]), vc, a[q][c]);
    }
  }
  for (int q = 0; q < Q; ++q)
    for (int c = 0; c < chunks; ++c) store16(acc + q * D + c * 16, a[q][c]);
}

// The first key token t may see: klo[t] (a sliding window), or 0 without klo (full attention).
inline int64_t lo_of(const int64_t* klo, int64_t t) { return klo == nullptr ? 0 : klo[t]; }

// e^x for x <= 0 with vec.h's lanes (the bits of every variant, as the keys' p_j)
inline float exp1(float x) {
  float r[W];
  store(r, exp_nonpositive(splat(x)));
  return r[0];
}

// Tokens [t0, t1) of one sequence (its slots sl) and one kv head: G query heads each at q (token t's
// at q + t * H * D), keys / values at k / v rows sl[j] * stride, outputs at out like q; sink: the G
// heads' sinks (nullptr: none).
template <int kChunks>
void attend(const float* q, int64_t t0, int64_t t1, int G, int64_t H, int D, const float* k, const float* v,
            const int64_t* sl, const int64_t* nkeys, const int64_t* klo, const float* sink, int64_t stride,
            float scale, float* out, std::vector<float>& sc, std::vector<float>& accs) {
  const int chunks = kChunks > 0 ? kChunks : D / 16;
  int64_t nmax = 0, kmin = nkeys[t0];
  for (int64_t t = t0; t < t1; ++t) nmax = std::max(nmax, nkeys[t]), kmin = std::min(kmin, lo_of(klo, t));
  const int64_t padded = (nmax + kBlock - 1) / kBlock * kBlock, nq = (t1 - t0) * G;
  sc.resize(static_cast<size_t>(nq * padded));
  for (int64_t j0 = kmin / kBlock * kBlock; j0 < nmax; j0 += kBlock) {  // scores, a block of keys for every query
    const float* kr[kBlock];
    for (int i = 0; i < kBlock; ++i) kr[i] = k + sl[j0 + i < nmax ? j0 + i : 0] * stride;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = nkeys[t], lo = lo_of(klo, t);
      if (j0 >= n || j0 + kBlock <= lo) continue;
      for (int g = 0; g < G; ++g) {
        const float* qg = q + (t * H + g) * D;
        F16 qv[kMaxChunks], acc[kBlock];
        for (int c = 0; c < chunks; ++c) qv[c] = load16(qg + c * 16);
        for (int i = 0; i < kBlock; ++i) {
          acc[i] = mul16(qv[0], load16(kr[i]));
          for (int c = 1; c < chunks; ++c) acc[i] = fmadd16(qv[c], load16(kr[i] + c * 16), acc[i]);
        }
        float* s = sc.data() + ((t - t0) * G + g) * padded + j0;
        reduce_block(acc, scale, s);
        for (int64_t j = n - j0; j < kBlock; ++j) s[j] = -INFINITY;  // keys it may not see: after it,
        for (int64_t j = 0; j < lo - j0; ++j) s[j] = -INFINITY;      // before its window
      }
    }
  }
  float inv[kRows * kMaxGroup];
  for (int64_t i = 0; i < nq; ++i) {  // p_j = exp(s_j - max) in place, 1 / sum p
    float* s = sc.data() + i * padded;
    const int64_t pt = (nkeys[t0 + i / G] + 15) / 16 * 16, pa = lo_of(klo, t0 + i / G) / 16 * 16;
    V vmx = splat(-INFINITY);
    for (int64_t j = pa; j < pt; j += W) vmx = vmax(vmx, load(s + j));
    const float mx = sink == nullptr ? reduce_max(vmx) : std::max(reduce_max(vmx), sink[i % G]);  // exact in any order
    const V m = splat(mx);
    F16 vsum = splat16(0.0f);
    for (int64_t j = pa; j < pt; j += 16) {  // the blocks before pa would add exp(-inf) = 0 to each lane
      for (int c = 0; c < 16 / W; ++c) {
        const V e = exp_nonpositive(sub(load(s + j + c * W), m));  // -inf -> 0
        store(s + j + c * W, e);
        vsum.p[c] = add(vsum.p[c], e);
      }
    }
    inv[i] = 1.0f / (sink == nullptr ? reduce_add16(vsum) : reduce_add16(vsum) + exp1(sink[i % G] - mx));
  }
  accs.assign(static_cast<size_t>(nq * D), 0.0f);
  constexpr int kQ = kChunks == 0 ? 1 : std::max(1, std::min(4, 16 / kChunks));  // 16 accumulators (zmm)
  for (int64_t j0 = kmin; j0 < nmax; j0 += kVChunk) {  // sum p_j v_j in key order, a chunk of values for every query
    const int64_t j1 = std::min(nmax, j0 + kVChunk);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t je = std::min(j1, nkeys[t]), js = std::max(j0, lo_of(klo, t));  // p_j = 0 before the window
      if (js >= je) continue;
      for (int g = 0; g < G; g += kQ) {  // up to kQ heads of the token at once (independent sums)
        const int64_t i = (t - t0) * G + g;
        const float* s = sc.data() + i * padded;
        float* ai = accs.data() + i * D;
        switch (std::min(kQ, G - g)) {
          case 4: value_sums<kChunks, 4>(s, padded, ai, D, js, je, sl, v, stride, chunks); break;
          case 3: value_sums<kChunks, 3>(s, padded, ai, D, js, je, sl, v, stride, chunks); break;
          case 2: value_sums<kChunks, 2>(s, padded, ai, D, js, je, sl, v, stride, chunks); break;
          default: value_sums<kChunks, 1>(s, padded, ai, D, js, je, sl, v, stride, chunks);
        }
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = t0 + i / G, g = i % G;
    const F16 is = splat16(inv[i]);
    for (int c = 0; c < chunks; ++c) store16(out + (t * H + g) * D + c * 16, mul16(load16(accs.data() + i * D + c * 16), is));
  }
}

}  // namespace

void attention_rows(const float* q, int64_t T, int64_t H, int64_t D, const float* k, const float* v, int64_t KH,
                    const int64_t* slots, int64_t L, const int64_t* seq, const int64_t* nkeys, const int64_t* klo,
                    const float* sinks, float scale, float* out) {
  const int G = static_cast<int>(H / KH);
  std::vector<int64_t> starts;  // runs of up to kRows consecutive tokens of one sequence
  int64_t keys = 0;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(nkeys[t] >= 1 && nkeys[t] <= L, "a token must see 1 to L keys");
    TORCH_CHECK(lo_of(klo, t) >= 0 && lo_of(klo, t) < nkeys[t], "a token's window must start at 0 .. its position");
    if (t == 0 || seq[t] != seq[t - 1] || t - starts.back() == kRows) starts.push_back(t);
    keys += nkeys[t];
  }
  starts.push_back(T);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1, work = runs * KH;
  const int64_t grain = std::max<int64_t>(1, work * 4096 / std::max<int64_t>(1, keys * H * D));
  at::parallel_for(0, work, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> sc, accs;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t r = w / KH, h = w % KH, t0 = starts[r], t1 = starts[r + 1];
      const float* qh = q + h * G * D;
      const int64_t* sl = slots + seq[t0] * L;
      float* oh = out + h * G * D;
      const float* sk = sinks == nullptr ? nullptr : sinks + h * G;
      switch (D) {
        case 64: attend<4>(qh, t0, t1, G, H, 64, k + h * D, v + h * D, sl, nkeys, klo, sk, KH * D, scale, oh, sc, accs); break;
        case 128: attend<8>(qh, t0, t1, G, H, 128, k + h * D, v + h * D, sl, nkeys, klo, sk, KH * D, scale, oh, sc, accs); break;
        default: attend<0>(qh, t0, t1, G, H, static_cast<int>(D), k + h * D, v + h * D, sl, nkeys, klo, sk, KH * D, scale, oh, sc, accs);
      }
    }
  });
}

void check_attention_shape(int64_t H, int64_t KH, int64_t D) {
  TORCH_CHECK(D % 16 == 0 && D / 16 <= kMaxChunks, "head_dim must be 16..256, a multiple of 16");
  TORCH_CHECK(H % KH == 0 && H / KH <= kMaxGroup, "q heads must be a multiple of kv heads (at most 16 per kv head)");
}
at::Tensor paged_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor slots,
                              at::Tensor seq, at::Tensor nkeys, double scale, std::optional<at::Tensor> klo,
                              std::optional<at::Tensor> sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q must be [T, H, D] float32");
  TORCH_CHECK(k.dim() == 3 && k.scalar_type() == at::kFloat && k.is_contiguous(), "k must be [S, KH, D]");
  TORCH_CHECK(v.sizes() == k.sizes() && v.scalar_type() == at::kFloat && v.is_contiguous(), "v like k");
  q = q.contiguous();
  slots = slots.to(at::kLong).contiguous();
  seq = seq.to(at::kLong).contiguous();
  nkeys = nkeys.to(at::kLong).contiguous();
  at::Tensor lo = klo.has_value() ? klo->to(at::kLong).contiguous() : at::Tensor();
  TORCH_CHECK(!lo.defined() || lo.numel() == nkeys.numel(), "klo: one per token");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KH = k.size(1), L = slots.size(1);
  TORCH_CHECK(k.size(2) == D, "q and k disagree on head_dim");
  check_attention_shape(H, KH, D);
  at::Tensor sk = sinks.has_value() ? sinks->contiguous() : at::Tensor();
  TORCH_CHECK(!sk.defined() || (sk.scalar_type() == at::kFloat && sk.numel() == H && sk.device().is_cpu()),
              "sinks must be float32 [q heads] on the CPU");
  auto out = at::empty({T, H, D}, q.options());
  attention_rows(q.data_ptr<float>(), T, H, D, k.data_ptr<float>(), v.data_ptr<float>(), KH, slots.data_ptr<int64_t>(), L,
                 seq.data_ptr<int64_t>(), nkeys.data_ptr<int64_t>(), lo.defined() ? lo.data_ptr<int64_t>() : nullptr,
                 sk.defined() ? sk.data_ptr<float>() : nullptr, static_cast<float>(scale), out.data_ptr<float>());
  return out;
}
