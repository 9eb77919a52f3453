// The CPU ops of serving/kernels/cpu_ext.py: one extension module, one file per op.
#pragma once
#include <torch/extension.h>

// int8_linear.cpp: x [M, K] float32, w [N, K] int8, wsum [N] int64, ws [N] float32 -> [M, N] float32
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor wsum, torch::Tensor ws);

// paged_attention.cpp: q [T, H, D], k/v [S, KH, D] float32; token t reads the first nkeys[t] slots of
// row seq[t] of slots [B, L] -> [T, H, D]
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                              torch::Tensor seq, torch::Tensor nkeys, double scale);

// rope_store.cpp: rotated q and k [T, H + KH, D] of qkv [T, W] at positions (rows of the cos/sin
// tables [L, D]); and k/v [T, KH, D] copied into the caches' flat slots loc [T]
torch::Tensor rope_qk(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                      int64_t heads, int64_t kv_heads, int64_t head_dim);
void store_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor loc, torch::Tensor k, torch::Tensor v);

// int4_linear.cpp: x [M, K] float32, w [N / 16, K / 32, 320] uint8 (Q4_1 blocks, packed) -> [M, N] float32
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor w);
