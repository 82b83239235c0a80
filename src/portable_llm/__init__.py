"""portable_llm: LLM building blocks written once against the Python Array API standard.

Runs on NumPy (the float64 reference), PyTorch, MLX, JAX and array-api-strict. Importing this
package imports no array library besides NumPy; a backend is loaded when first used.
"""

from portable_llm.attn.block import attention
from portable_llm.attn.mask import causal_mask
from portable_llm.attn.padding import left_pad
from portable_llm.attn.paged import paged_attention
from portable_llm.attn.sdpa import scaled_dot_product_attention
from portable_llm.backends import (
    BACKENDS,
    BackendNotInstalledError,
    available_backends,
    get_backend,
)
from portable_llm.caches.kv import KVCache, RotatingKVCache
from portable_llm.caches.paged import PagedKVCache, PagePool, PagePoolExhausted
from portable_llm.core.arrays import asarray, device_of, to_numpy
from portable_llm.core.dispatch import (
    Trace,
    TraceEntry,
    register_kernel,
    trace,
    unregister_kernel,
)
from portable_llm.models import (
    BatchGenerator,
    Model,
    Request,
    batch_generate,
    generate,
    generate_step,
    load,
    make_logits_processors,
    make_sampler,
    speculative_generate,
)
from portable_llm.ops.activations import (
    ACTIVATIONS,
    activation,
    gelu,
    gelu_tanh,
    relu,
    silu,
    softmax,
)
from portable_llm.ops.embedding import embedding, unembed
from portable_llm.ops.linear import intermediate_size, linear, mlp
from portable_llm.ops.moe import moe, route
from portable_llm.ops.norm import rms_norm
from portable_llm.ops.quant import QuantizedWeight, dequantize, quantize, quantized_linear
from portable_llm.ops.sampling import greedy, logprobs, sample
from portable_llm.rotary.rope import apply_rope, rope, rope_cos_sin

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "BACKENDS",
    "BackendNotInstalledError",
    "BatchGenerator",
    "KVCache",
    "Model",
    "PagePool",
    "PagePoolExhausted",
    "PagedKVCache",
    "QuantizedWeight",
    "Request",
    "RotatingKVCache",
    "Trace",
    "TraceEntry",
    "__version__",
    "activation",
    "apply_rope",
    "asarray",
    "attention",
    "available_backends",
    "batch_generate",
    "causal_mask",
    "dequantize",
    "device_of",
    "embedding",
    "gelu",
    "gelu_tanh",
    "generate",
    "generate_step",
    "get_backend",
    "greedy",
    "intermediate_size",
    "left_pad",
    "linear",
    "load",
    "logprobs",
    "make_logits_processors",
    "make_sampler",
    "mlp",
    "moe",
    "paged_attention",
    "quantize",
    "quantized_linear",
    "register_kernel",
    "relu",
    "rms_norm",
    "rope",
    "rope_cos_sin",
    "route",
    "sample",
    "scaled_dot_product_attention",
    "silu",
    "softmax",
    "speculative_generate",
    "to_numpy",
    "trace",
    "unembed",
    "unregister_kernel",
]
