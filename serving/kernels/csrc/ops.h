// The CPU ops of serving/kernels/cpu_ext.py: one extension module per ISA variant (vec.h), built
// from the same sources; one file per op.
#pragma once
#include <torch/extension.h>

// int8_linear.cpp: x [M, K] float32, w [N, K] int8, wsum [N] int64, ws [N] float32 -> [M, N] float32
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor wsum, torch::Tensor ws);

// paged_attention.cpp: q [T, H, D], k/v [S, KH, D] float32; token t reads the first nkeys[t] slots of
// row seq[t] of slots [B, L] -> [T, H, D]
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                              torch::Tensor seq, torch::Tensor nkeys, double scale);
// the same on raw rows (decoder.cpp): q [T, H, D], k/v [S, KH, D], slots [B, L], out [T, H, D]
void attention_rows(const float* q, int64_t T, int64_t H, int64_t D, const float* k, const float* v, int64_t KH,
                    const int64_t* slots, int64_t L, const int64_t* seq, const int64_t* nkeys, float scale, float* out);
void check_attention_shape(int64_t H, int64_t KH, int64_t D);

// rope_store.cpp: rotated q and k [T, H + KH, D] of qkv [T, W] at positions (rows of the cos/sin
// tables [L, D]); and k/v [T, KH, D] copied into the caches' flat slots loc [T]
torch::Tensor rope_qk(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                      int64_t heads, int64_t kv_heads, int64_t head_dim);
void store_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor loc, torch::Tensor k, torch::Tensor v);

// group_linear.cpp: x [M, K] float32, w [N / 16, K / 32, 320] uint8 (Q4_1 blocks, packed) -> [M, N] float32
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w);
// group_linear.cpp: x [M, K] float32, w [N / 16, K / 32, 544] uint8 (Q8_0 blocks, packed) -> [M, N] float32
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor w);

// decoder.cpp: the DecoderStack class (a model's layers in one call per forward)
void bind_decoder(pybind11::module& m);
