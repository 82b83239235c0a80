"""portable_llm: LLM building blocks written once against the Python Array API standard.

Runs on NumPy (the float64 reference), PyTorch, MLX, JAX and array-api-strict. Importing this
package imports no array library besides NumPy; a backend is loaded when first used.
"""

from portable_llm.activations import ACTIVATIONS, activation, gelu, gelu_tanh, relu, silu, softmax
from portable_llm.arrays import asarray, device_of, to_numpy
from portable_llm.attention import attention
from portable_llm.backends import (
    BACKENDS,
    BackendNotInstalledError,
    available_backends,
    get_backend,
)
from portable_llm.cache import KVCache, RotatingKVCache
from portable_llm.embedding import embedding, unembed
from portable_llm.linear import intermediate_size, linear, mlp
from portable_llm.mask import causal_mask
from portable_llm.models import Model, generate, load
from portable_llm.moe import moe, route
from portable_llm.norm import rms_norm
from portable_llm.padding import left_pad
from portable_llm.rope import apply_rope, rope, rope_cos_sin
from portable_llm.sampling import greedy, logprobs, sample
from portable_llm.sdpa import scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "BackendNotInstalledError",
    "KVCache",
    "Model",
    "RotatingKVCache",
    "__version__",
    "activation",
    "apply_rope",
    "asarray",
    "attention",
    "available_backends",
    "causal_mask",
    "device_of",
    "embedding",
    "gelu",
    "gelu_tanh",
    "generate",
    "get_backend",
    "greedy",
    "intermediate_size",
    "left_pad",
    "linear",
    "load",
    "logprobs",
    "mlp",
    "moe",
    "relu",
    "rms_norm",
    "rope",
    "rope_cos_sin",
    "route",
    "sample",
    "scaled_dot_product_attention",
    "silu",
    "softmax",
    "to_numpy",
    "unembed",
]
