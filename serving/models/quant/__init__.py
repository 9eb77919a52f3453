"""``--quantization``: weight quantization methods (a registry of strategy classes) and the pass
that applies one to a loaded model. Importing this package registers int8, int4 (its head: q8_0) and fp8."""

from serving.models.quant import fp8, int4, int8, q8  # noqa: F401 - register the methods (and expose the modules)
from serving.models.quant.apply import QuantLinear, quantize_model
from serving.models.quant.base import QuantizationError, QuantMethod, get_quant_method, quant_methods

__all__ = ["QuantLinear", "QuantMethod", "QuantizationError", "get_quant_method", "quant_methods", "quantize_model"]
