"""Quantized weights in MLX's affine format, one module per concern:

- :mod:`~portable_llm.ops.quant.format`: the weight (``QuantizedWeight``, ``BITS``,
  ``GROUP_SIZES``, ``k_unit``);
- :mod:`~portable_llm.ops.quant.codes`: the codes' bit streams (packing and unpacking);
- :mod:`~portable_llm.ops.quant.kernels`: the portable kernels (exact mode: float activations);
- :mod:`~portable_llm.ops.quant.int8`: the 8-bit activation mode (``ACTIVATIONS``,
  ``projection_op``) and its portable kernel;
- :mod:`~portable_llm.ops.quant.policy`: the measured rules: when codes beat floats
  (``KEEP_CODES_FROM``, ``keeps_codes``), where int8 activations are the default
  (``INT8_BY_DEFAULT``, ``int8_by_default``);
- :mod:`~portable_llm.ops.quant.mxfp4`: MXFP4 (``MXFP4Weight``: FP4 E2M1 codes, an E8M0 scale per
  32), which ``dequantize`` and ``quantized_linear`` also take;
- :mod:`~portable_llm.ops.quant.public`: the public ops (``quantize``, ``dequantize``,
  ``quantized_linear``, ``fastest_form``).

The native kernels of these ops live in ``native/`` (one module per backend).
"""

from portable_llm.ops.quant.format import (
    BITS,
    GROUP_SIZES,
    QuantizedWeight,
    is_quantized,
    k_unit,
)
from portable_llm.ops.quant.int8 import ACTIVATIONS, projection_op
from portable_llm.ops.quant.mxfp4 import MXFP4Weight
from portable_llm.ops.quant.policy import (
    INT8_BY_DEFAULT,
    KEEP_CODES_FROM,
    device_kind,
    int8_by_default,
    keeps_codes,
)
from portable_llm.ops.quant.public import (
    dequantize,
    dequantized,
    fastest_form,
    quantize,
    quantized_embedding,
    quantized_linear,
)

__all__ = [
    "ACTIVATIONS",
    "BITS",
    "GROUP_SIZES",
    "INT8_BY_DEFAULT",
    "KEEP_CODES_FROM",
    "MXFP4Weight",
    "QuantizedWeight",
    "dequantize",
    "dequantized",
    "device_kind",
    "fastest_form",
    "int8_by_default",
    "is_quantized",
    "k_unit",
    "keeps_codes",
    "projection_op",
    "quantize",
    "quantized_embedding",
    "quantized_linear",
]
