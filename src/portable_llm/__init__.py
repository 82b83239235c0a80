"""portable_llm: LLM building blocks written once against the Python Array API standard.

Runs on NumPy (the float64 reference), PyTorch, MLX, JAX and array-api-strict. Importing this
package imports no array library besides NumPy; a backend is loaded when first used.
"""

from portable_llm.activations import ACTIVATIONS, activation, gelu, gelu_tanh, relu, silu, softmax
from portable_llm.arrays import asarray, device_of, to_numpy
from portable_llm.backends import BACKENDS, BackendNotInstalledError, available_backends, get_backend
from portable_llm.linear import intermediate_size, linear, mlp
from portable_llm.norm import rms_norm

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "BackendNotInstalledError",
    "__version__",
    "activation",
    "asarray",
    "available_backends",
    "device_of",
    "gelu",
    "gelu_tanh",
    "get_backend",
    "intermediate_size",
    "linear",
    "mlp",
    "relu",
    "rms_norm",
    "silu",
    "softmax",
    "to_numpy",
]
