#include "ops.h"
#include "vec.h"

#if defined(__AVX512F__)
#define HV_ISA "avx512vnni"
#elif defined(__AVXVNNI__)
#define HV_ISA "avxvnni"
#elif defined(__AVX2__)
#define HV_ISA "avx2"
#else
#define HV_ISA "scalar"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("variant") = HV_ISA;  // what this module was compiled for (vec.h)
  m.attr("lanes") = hv::W;
  m.def("int8_linear", &int8_linear, "int8 W8A8 linear, per-token asymmetric activations");
  m.def("int4_linear", &int4_linear, "int4 W4A8 linear: Q4_1 weight blocks x per-group int8 activations");
  m.def("q8_linear", &q8_linear, "W8A8 linear: Q8_0 weight blocks x per-group int8 activations");
  m.def("rope_qk", &rope_qk, "rotary embedding of q and k from the fused qkv (float32, exact)");
  m.def("store_kv", &store_kv, "copy k/v rows into the caches' flat slots");
  m.def("paged_attention", &paged_attention, "causal GQA attention over paged float32 KV, one query at a time");
  bind_decoder(m);
}
