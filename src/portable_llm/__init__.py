"""portable_llm: LLM building blocks written once against the Python Array API standard.

Runs on NumPy (the float64 reference), PyTorch, MLX, JAX and array-api-strict. Importing this
package imports no array library besides NumPy; a backend is loaded when first used.
"""

# Ops: each written once against the Array API, with native kernels where a backend has them.
from portable_llm import models
from portable_llm.attn.block import attention
from portable_llm.attn.latent import latent_attention
from portable_llm.attn.mask import causal_mask
from portable_llm.attn.padding import left_pad
from portable_llm.attn.paged import paged_attention
from portable_llm.attn.sdpa import scaled_dot_product_attention
from portable_llm.attn.temperature import attention_temperature

# Backends, arrays and the dispatcher.
from portable_llm.backends import (
    BACKENDS,
    BackendNotInstalledError,
    available_backends,
    get_backend,
)

# Caches.
from portable_llm.caches.kv import KVCache, RotatingKVCache
from portable_llm.caches.paged import PagedKVCache, PagePool, PagePoolExhausted
from portable_llm.caches.recurrent import RecurrentCache, RecurrentSlots

# Models: the decoder, reading checkpoints, text.
from portable_llm.checkpoint import CheckpointError, load, read_config
from portable_llm.core.arrays import asarray, device_of, to_numpy
from portable_llm.core.dispatch import (
    Trace,
    TraceEntry,
    register_kernel,
    trace,
    unregister_kernel,
)
from portable_llm.core.version import __version__
from portable_llm.decoder import SUPPORTED_MODEL_TYPES, DecoderConfig, Model

# Generation over any model (docs/bring-your-own-model.md).
from portable_llm.generation import (
    BatchGenerator,
    Generation,
    GenerationStats,
    LanguageModel,
    PagedLanguageModel,
    Request,
    SpeculativeStats,
    batch_generate,
    generate,
    generate_step,
    make_logits_processors,
    make_sampler,
    perplexity,
    speculative_generate,
)
from portable_llm.ops.activations import (
    ACTIVATIONS,
    activation,
    clamped_swiglu,
    gelu,
    gelu_tanh,
    relu,
    silu,
    softmax,
)
from portable_llm.ops.delta_rule import gated_delta_rule
from portable_llm.ops.embedding import embedding, unembed
from portable_llm.ops.gated_norm import gated_rms_norm
from portable_llm.ops.linear import intermediate_size, linear, mlp
from portable_llm.ops.mamba2 import Mamba2Weights, mamba2_mixer
from portable_llm.ops.moe import moe, route
from portable_llm.ops.norm import layer_norm, rms_norm
from portable_llm.ops.penalties import apply_penalties, logit_bias_row
from portable_llm.ops.quant import (
    MXFP4Weight,
    QuantizedWeight,
    dequantize,
    quantize,
    quantized_linear,
)
from portable_llm.ops.sampling import greedy, logprobs, sample
from portable_llm.ops.short_conv import short_conv
from portable_llm.ops.ssd import ssd_scan
from portable_llm.rotary.rope import apply_rope, rope, rope_cos_sin
from portable_llm.text import TextStream, Tokenizer

__all__ = [
    # ops
    "ACTIVATIONS",
    "activation",
    "apply_rope",
    "attention",
    "attention_temperature",
    "causal_mask",
    "clamped_swiglu",
    "dequantize",
    "embedding",
    "gated_delta_rule",
    "gated_rms_norm",
    "gelu",
    "gelu_tanh",
    "greedy",
    "intermediate_size",
    "latent_attention",
    "layer_norm",
    "left_pad",
    "linear",
    "logprobs",
    "mamba2_mixer",
    "Mamba2Weights",
    "mlp",
    "moe",
    "paged_attention",
    "MXFP4Weight",
    "QuantizedWeight",
    "quantize",
    "quantized_linear",
    "relu",
    "rms_norm",
    "rope",
    "rope_cos_sin",
    "route",
    "sample",
    "apply_penalties",
    "logit_bias_row",
    "scaled_dot_product_attention",
    "short_conv",
    "silu",
    "softmax",
    "ssd_scan",
    "unembed",
    # backends, arrays, dispatch
    "BACKENDS",
    "BackendNotInstalledError",
    "Trace",
    "TraceEntry",
    "__version__",
    "asarray",
    "available_backends",
    "device_of",
    "get_backend",
    "register_kernel",
    "to_numpy",
    "trace",
    "unregister_kernel",
    # caches
    "KVCache",
    "PagePool",
    "PagePoolExhausted",
    "PagedKVCache",
    "RecurrentCache",
    "RecurrentSlots",
    "RotatingKVCache",
    # models
    "SUPPORTED_MODEL_TYPES",
    "CheckpointError",
    "DecoderConfig",
    "Model",
    "TextStream",
    "Tokenizer",
    "load",
    "models",
    "read_config",
    # generation
    "BatchGenerator",
    "Generation",
    "GenerationStats",
    "LanguageModel",
    "PagedLanguageModel",
    "Request",
    "SpeculativeStats",
    "batch_generate",
    "generate",
    "generate_step",
    "make_logits_processors",
    "make_sampler",
    "perplexity",
    "speculative_generate",
]
