// The CPU ops of serving/kernels/cpu_ext.py: one extension module per ISA variant (vec.h), built
// from the same sources; one file per op. The ops see ATen's Tensor and the few ATen functions they
// call (~2 s of g++ per file); only bindings.cpp parses pybind11. torch/extension.h in every file
// cost ~23 s each, most of what `make setup` spent building the variants.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

// int8_linear.cpp: x [M, K] float32, w [N, K] int8, wsum [N] int64, ws [N] float32 -> [M, N] float32
at::Tensor int8_linear(at::Tensor x, at::Tensor w, at::Tensor wsum, at::Tensor ws);

// paged_attention.cpp: q [T, H, D], k/v [S, KH, D] float32; token t reads the first nkeys[t] slots of
// row seq[t] of slots [B, L] (from slot klo[t] on with a sliding window; sinks [H] float32: attention
// sinks, a logit per q head in the softmax's denominator) -> [T, H, D]
at::Tensor paged_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor slots,
                              at::Tensor seq, at::Tensor nkeys, double scale, std::optional<at::Tensor> klo,
                              std::optional<at::Tensor> sinks);
// the same on raw rows (decoder.cpp): q [T, H, D], k/v [S, KH, D], slots [B, L], out [T, H, D]; klo
// nullptr: every token from key 0; sinks nullptr: none
void attention_rows(const float* q, int64_t T, int64_t H, int64_t D, const float* k, const float* v, int64_t KH,
                    const int64_t* slots, int64_t L, const int64_t* seq, const int64_t* nkeys, const int64_t* klo,
                    const float* sinks, float scale, float* out);
void check_attention_shape(int64_t H, int64_t KH, int64_t D);

// rope_store.cpp: rotated q and k [T, H + KH, D] of qkv [T, W] at positions (rows of the cos/sin
// tables [L, D]); and k/v [T, KH, D] copied into the caches' flat slots loc [T]
at::Tensor rope_qk(at::Tensor qkv, at::Tensor positions, at::Tensor cos, at::Tensor sin,
                      int64_t heads, int64_t kv_heads, int64_t head_dim);
void store_kv(at::Tensor k_cache, at::Tensor v_cache, at::Tensor loc, at::Tensor k, at::Tensor v);

// group_linear.cpp: x [M, K] float32, w [N / 16, K / 32, 320] uint8 (Q4_1 blocks, packed) -> [M, N] float32
at::Tensor int4_linear(at::Tensor x, at::Tensor w);
// group_linear.cpp: x [M, K] float32, w [N / 16, K / 32, 544] uint8 (Q8_0 blocks, packed) -> [M, N] float32
at::Tensor q8_linear(at::Tensor x, at::Tensor w);

// decoder.cpp: a model's layers in one call per forward (the state lives in decoder.cpp's Impl)
class DecoderStack {
 public:
  DecoderStack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, double eps);
  ~DecoderStack();
  void add_layer(at::Tensor norm1, at::Tensor norm2, int64_t qkv_kind, std::vector<at::Tensor> qkv,
                 std::optional<at::Tensor> qkv_bias, int64_t o_kind, std::vector<at::Tensor> o,
                 std::optional<at::Tensor> o_bias, int64_t gu_kind, std::vector<at::Tensor> gu,
                 std::optional<at::Tensor> gu_bias, int64_t down_kind, std::vector<at::Tensor> down,
                 std::optional<at::Tensor> down_bias);
  int64_t num_layers() const;
  // layer `layer` attends to the last `window` positions only (0: all of them)
  void set_window(int64_t layer, int64_t window);
  // layer `layer` has attention sinks [heads] float32 (GPT-OSS; kept, not copied)
  void set_sinks(int64_t layer, at::Tensor sinks);
  // Layers [first, last) on the residual stream h [T, hidden] (updated in place); delta: the
  // previous layer's output not yet added (None before layer 0). Returns this call's last delta.
  at::Tensor forward(at::Tensor h, std::optional<at::Tensor> delta, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, at::Tensor cos, at::Tensor sin, at::Tensor positions,
                     at::Tensor loc, at::Tensor page_table, int64_t page_size, at::Tensor prefix_lens,
                     at::Tensor extend_lens, double scale, int64_t first, int64_t last);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
// decoder.cpp: y = w * (x * r) per row (the final norm of the fused path)
at::Tensor rmsnorm(at::Tensor x, at::Tensor w, double eps);
