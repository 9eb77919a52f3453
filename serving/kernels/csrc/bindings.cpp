#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "int8 W8A8 linear, per-token asymmetric activations (AVX-512 VNNI)");
  m.def("int4_linear", &int4_linear, "int4 W4A8 linear: Q4_1 weight blocks x per-group int8 activations (AVX-512 VNNI)");
  m.def("rope_qk", &rope_qk, "rotary embedding of q and k from the fused qkv (float32, exact)");
  m.def("store_kv", &store_kv, "copy k/v rows into the caches' flat slots");
  m.def("paged_attention", &paged_attention, "causal GQA attention over paged float32 KV, one query at a time");
}
