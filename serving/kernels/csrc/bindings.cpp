// The one file that parses pybind11 and torch's Tensor casters (torch/csrc/utils/pybind.h, ~12 s of
// g++; all of torch/extension.h would be ~23 s); the ops (ops.h) see ATen only.
#include "ops.h"
#include "vec.h"

#include <torch/csrc/utils/pybind.h>

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
  m.def("paged_attention", &paged_attention, "causal GQA attention over paged float32 KV, one query at a time",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("slots"), pybind11::arg("seq"),
        pybind11::arg("nkeys"), pybind11::arg("scale"), pybind11::arg("klo") = pybind11::none(),
        pybind11::arg("sinks") = pybind11::none());
  namespace py = pybind11;
  // module_local: every variant's module binds the same C++ type; each keeps its own Python class
  py::class_<DecoderStack>(m, "DecoderStack", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("num_layers", &DecoderStack::num_layers)
      .def("set_window", &DecoderStack::set_window)
      .def("set_sinks", &DecoderStack::set_sinks)
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>());
  m.def("rmsnorm", &rmsnorm, "RMSNorm of rows in the fused decoder's order");
}
