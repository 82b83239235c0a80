"""``portable-llm report``: every op on every installed backend against the float64 reference.

For each backend, op (a :class:`Case` of :data:`CASES`) and float dtype the backend supports, the
op runs on inputs from :func:`~portable_llm.testing.random_array` with a fixed seed; the result
is compared with :mod:`portable_llm.testing.reference`
evaluated in float64 on the same rounded inputs,
with :func:`~portable_llm.testing.assert_close` and the tolerance of
:data:`~portable_llm.testing.TOLERANCES`. ``impl="auto"`` is reported with the path it took
(native kernel or portable) and beside it the path it did not take: ``impl="portable"`` when
it ran a native kernel, ``impl="native"`` when it passed one over.

The output fits 100 columns. Per backend: a start line, the lines that explain the error
columns, the table, and an end line with the backend's time. By default the table has one line
per case: its dtypes, the paths ``auto`` took, the worst ``err/tol`` and result. With
``verbose`` (``-v``) it has a row per case, dtype and impl (its path column is the short form,
``native``, ``portable``, ``tiled`` or ``native+portable``, of what :func:`portable_llm.trace`
recorded), followed by the tolerances and the kernels behind each path (one line per case and
path, listing the dtypes where paths differ). ``err/tol`` is the worst element's error over
the error allowed there (``atol + rtol |ref|``): a row is within tolerance when it is at most
1. (A relative error alone can exceed 1 on an "ok" row, where the reference is near zero and
``atol`` decides.)

A new op adds one :class:`Case` to :data:`CASES`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, TextIO

import numpy as np

from portable_llm.attn.block import attention
from portable_llm.attn.latent import latent_attention
from portable_llm.attn.paged import paged_attention
from portable_llm.attn.sdpa import scaled_dot_product_attention
from portable_llm.attn.temperature import attention_temperature
from portable_llm.backends import (
    BACKENDS,
    FLOAT_DTYPES,
    Backend,
    BackendNotInstalledError,
    backend_of,
    get_backend,
    numpy_bfloat16,
)
from portable_llm.caches.kv import KVCache
from portable_llm.cli.options import backend_name
from portable_llm.cli.output import Phases, Table, UsageError, wrap
from portable_llm.core.arrays import asarray, to_numpy
from portable_llm.core.dispatch import TraceEntry, dispatcher, replay, trace
from portable_llm.decoder.layer_weights import Packed, QLinear, bind_weight
from portable_llm.extras import install_hint
from portable_llm.ops.activations import clamped_swiglu, gelu, gelu_tanh, relu, silu, softmax
from portable_llm.ops.delta_rule import gated_delta_rule
from portable_llm.ops.embedding import embedding, unembed
from portable_llm.ops.gated_norm import gated_rms_norm
from portable_llm.ops.linear import linear, mlp
from portable_llm.ops.moe import moe
from portable_llm.ops.moe import route as moe_route
from portable_llm.ops.norm import layer_norm, rms_norm
from portable_llm.ops.quant import (
    MXFP4Weight,
    QuantizedWeight,
    dequantize,
    quantize,
    quantized_linear,
)
from portable_llm.ops.sampling import logprobs
from portable_llm.ops.short_conv import short_conv
from portable_llm.ops.ssd import ssd_scan
from portable_llm.rotary.rope import rope
from portable_llm.testing import (
    BACKEND_TOLERANCES,
    LATENT_DIMS,
    Tolerance,
    assert_close,
    compare_values,
    random_array,
    random_latent_layer,
    random_weight,
    reference,
    tolerance,
)

__all__ = ["CASES", "Case", "Inputs", "Row", "UsageError", "format_table", "run_report"]


@dataclass(frozen=True)
class Inputs:
    """One call's arguments: the backend's arrays, their exact float64 copies, the options."""

    arrays: tuple[Any, ...]
    refs: tuple[np.ndarray, ...]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """One op of the report.

    ``build(seed, dtype, backend)`` draws the inputs; the op runs as
    ``call(*inputs.arrays, impl=impl, **inputs.options)`` and the reference as
    ``reference(*inputs.refs, **inputs.options)``. The path column is what the dispatcher
    recorded while the call ran.
    ``out_dtype(dtype)`` is the dtype the result must have for inputs in ``dtype`` (default: the
    same); its tolerance applies.
    """

    name: str
    op: str
    build: Callable[[int, str, str], Inputs]
    call: Callable[..., Any]
    reference: Callable[..., np.ndarray]
    seed: int = 0
    out_dtype: Callable[[str], str] | None = None


def _inputs(*drawn: tuple[Any, np.ndarray], **options: Any) -> Inputs:
    return Inputs(tuple(a for a, _ in drawn), tuple(r for _, r in drawn), options)


_X = (2, 5, 64)  # (B, L, E): small, so the report runs in a second per backend


def _unary(op: str, fn: Callable[..., Any], ref: Callable[..., np.ndarray]) -> Case:
    def build(seed: int, dtype: str, backend: str) -> Inputs:
        return _inputs(random_array(seed, _X, dtype, backend=backend))

    return Case(op, op, build, fn, ref, seed=10)


def _softmax(seed: int, dtype: str, backend: str) -> Inputs:
    return _inputs(random_array(seed, (2, 3, 7, 33), dtype, backend=backend, scale=2.0), axis=-1)


def _rms_norm(seed: int, dtype: str, backend: str) -> Inputs:
    x = random_array(seed, _X, dtype, backend=backend)
    w = random_array(seed + 1, _X[-1:], dtype, backend=backend, low=0.5, high=1.5)
    return _inputs(x, w, eps=1e-6)


def _rms_norm_offset(seed: int, dtype: str, backend: str) -> Inputs:
    x = random_array(seed, _X, dtype, backend=backend)
    w = random_array(seed + 1, _X[-1:], dtype, backend=backend, low=-0.5, high=0.5)
    return _inputs(x, w, eps=1e-6, offset=1.0)  # Gemma's (1 + w)


def _layer_norm(seed: int, dtype: str, backend: str) -> Inputs:
    x = random_array(seed, _X, dtype, backend=backend, low=-1.0, high=3.0)
    w = random_array(seed + 1, _X[-1:], dtype, backend=backend, low=0.5, high=1.5)
    b = random_array(seed + 2, _X[-1:], dtype, backend=backend, scale=0.1)
    return _inputs(x, w, b, eps=1e-5)


def _linear(bias: bool) -> Callable[[int, str, str], Inputs]:
    def build(seed: int, dtype: str, backend: str) -> Inputs:
        x = random_array(seed, _X, dtype, backend=backend)
        w = random_weight(seed + 1, (48, _X[-1]), dtype, backend=backend)
        if not bias:
            return _inputs(x, w)
        return _inputs(x, w, random_array(seed + 2, (48,), dtype, backend=backend, scale=0.1))

    return build


def _mlp(seed: int, dtype: str, backend: str) -> Inputs:
    e, i = _X[-1], 160
    x = random_array(seed, _X, dtype, backend=backend)
    w_gate = random_weight(seed + 1, (i, e), dtype, backend=backend)
    w_up = random_weight(seed + 2, (i, e), dtype, backend=backend)
    w_down = random_weight(seed + 3, (e, i), dtype, backend=backend)
    return _inputs(x, w_gate, w_up, w_down, act="silu")


def _rope(seed: int, dtype: str, backend: str) -> Inputs:
    # Qwen2-0.5B's head_dim and rope_theta; positions 5..12 keep float32 angles exact to ~1e-6.
    x = random_array(seed, (2, 4, 8, 64), dtype, backend=backend, low=-1.0, high=1.0)
    return _inputs(x, offset=5, base=1e6)


def _temperature(seed: int, dtype: str, backend: str) -> Inputs:
    # Positions 16380..16387 straddle 2 * floor_scale: factors log(2)/10 + 1 and log(3)/10 + 1.
    x = random_array(seed, (2, 4, 8, 64), dtype, backend=backend)
    return _inputs(x, offset=16380, floor_scale=8192.0, scale=0.1)


def _temperature_reference(q: np.ndarray, *, offset: int, **options: Any) -> np.ndarray:
    return reference.attention_temperature(q, np.arange(offset, offset + q.shape[-2]), **options)


def _rope_reference(x: np.ndarray, *, offset: int, **options: Any) -> np.ndarray:
    return reference.rope(x, np.arange(offset, offset + x.shape[-2]), **options)


#: The ops of the report, in table order. Later ops append one entry each.
CASES: list[Case] = [
    _unary("silu", silu, reference.silu),
    _unary("gelu", gelu, reference.gelu),
    _unary("gelu_tanh", gelu_tanh, reference.gelu_tanh),
    _unary("relu", relu, reference.relu),
    Case("softmax", "softmax", _softmax, softmax, reference.softmax, seed=20),
    Case("rms_norm", "rms_norm", _rms_norm, rms_norm, reference.rms_norm, seed=30),
    Case(
        "rms_norm(1+w)", "rms_norm_offset", _rms_norm_offset, rms_norm, reference.rms_norm, seed=32
    ),
    Case("layer_norm", "layer_norm", _layer_norm, layer_norm, reference.layer_norm, seed=35),
    Case("linear", "linear", _linear(False), linear, reference.linear, seed=40),
    Case("linear+bias", "linear", _linear(True), linear, reference.linear, seed=50),
    Case("mlp", "mlp", _mlp, mlp, reference.mlp, seed=60),
    Case("rope", "rope", _rope, rope, _rope_reference, seed=70),
    Case(
        "attention_temperature",
        "attention_temperature",
        _temperature,
        attention_temperature,
        _temperature_reference,
        seed=75,
    ),
]


# -- decoding: embedding, the tied LM head, the MoE router and block --------------------------

_VOCAB, _EXPERTS, _TOP_K = 40, 8, 2


def _embedding(seed: int, dtype: str, backend: str) -> Inputs:
    ids = np.random.default_rng(seed).integers(0, _VOCAB, size=_X[:2])
    table = random_array(seed + 1, (_VOCAB, _X[-1]), dtype, backend=backend)
    return _inputs((asarray(ids, backend=backend), ids), table)


def _unembed(seed: int, dtype: str, backend: str) -> Inputs:
    h = random_array(seed, _X, dtype, backend=backend)
    return _inputs(h, random_weight(seed + 1, (_VOCAB, _X[-1]), dtype, backend=backend))


def _router(seed: int, dtype: str, backend: str, biased: bool = False) -> tuple[Any, ...]:
    """x and a router (``biased``: and its bias ``(X,)``) whose top-k choice has no near-tie
    within dtype's rounding (then the experts chosen in dtype and in float64 agree, and the
    comparison is of numbers)."""
    for s in range(seed, seed + 10_000, 10):
        x = random_array(s, _X, dtype, backend=backend)
        w = random_weight(s + 1, (_EXPERTS, _X[-1]), dtype, backend=backend)
        b = random_array(s + 2, (_EXPERTS,), dtype, backend=backend, low=-0.5, high=0.5)
        logits = reference.linear(x[1], w[1], b[1] if biased else None)
        logits = -np.sort(-logits, axis=-1)
        gap = logits[..., _TOP_K - 1] - logits[..., _TOP_K]
        if (gap > tolerance(dtype).rtol * np.abs(logits).max()).all():
            break
    return (x, w, b) if biased else (x, w)


def _route_case(seed: int, dtype: str, backend: str) -> Inputs:
    return _inputs(*_router(seed, dtype, backend), top_k=_TOP_K, norm_topk_prob=False)


def _route_weights(x: Any, w: Any, *, impl: str = "auto", **options: Any) -> Any:
    # The weights (descending), rounded to x's dtype as Qwen2-MoE does, for the table.
    weights, _ = moe_route(x, w, impl=impl, **options)
    bk = backend_of(x)
    assert bk is not None
    return bk.astype(weights, x.dtype)


def _moe_case(seed: int, dtype: str, backend: str) -> Inputs:
    e, i, i_shared = _X[-1], 32, 48
    shapes = [(_EXPERTS, i, e), (_EXPERTS, i, e), (_EXPERTS, e, i), (i_shared, e), (i_shared, e),
              (e, i_shared), (1, e)]  # fmt: skip
    weights = [
        random_weight(seed + 2 + j, sh, dtype, backend=backend) for j, sh in enumerate(shapes)
    ]
    return _inputs(*_router(seed, dtype, backend), *weights, top_k=_TOP_K, norm_topk_prob=False)


def _moe_call(x: Any, w: Any, g: Any, u: Any, d: Any, sg: Any, su: Any, sd: Any, sgate: Any,
              **options: Any) -> Any:  # fmt: skip
    return moe(x, w, g, u, d, shared=(sg, su, sd), shared_gate=sgate, **options)


def _moe_reference(x: Any, w: Any, g: Any, u: Any, d: Any, sg: Any, su: Any, sd: Any,
                   sgate: Any, *, top_k: int, norm_topk_prob: bool) -> np.ndarray:  # fmt: skip
    return reference.moe(x, w, g, u, d, top_k=top_k, norm_topk_prob=norm_topk_prob,
                         shared=(sg, su, sd), shared_gate=sgate)  # fmt: skip


# Llama 4: the sigmoid router (its top-k logits' sigmoid scales each expert's input), a shared
# expert without a gate; the weightless RMS norm of its q and k heads (Llama4TextL2Norm).
def _route_sigmoid_case(seed: int, dtype: str, backend: str) -> Inputs:
    return _inputs(*_router(seed, dtype, backend), top_k=_TOP_K, router="sigmoid")


def _moe_sigmoid_call(x: Any, w: Any, g: Any, u: Any, d: Any, sg: Any, su: Any, sd: Any,
                      sgate: Any, **options: Any) -> Any:  # fmt: skip
    return moe(x, w, g, u, d, shared=(sg, su, sd), router="sigmoid", **options)


def _moe_sigmoid_reference(
    x: Any, w: Any, g: Any, u: Any, d: Any, sg: Any, su: Any, sd: Any, sgate: Any, *, top_k: int,
    norm_topk_prob: bool,
) -> np.ndarray:  # fmt: skip
    return reference.moe(x, w, g, u, d, top_k=top_k, shared=(sg, su, sd), router="sigmoid")


def _l2_norm_case(seed: int, dtype: str, backend: str) -> Inputs:
    return _inputs(random_array(seed, (2, 4, 5, 64), dtype, backend=backend), eps=1e-5)


CASES.extend([
    Case("embedding", "embedding", _embedding, lambda ids, table, *, impl: embedding(ids, table),
         reference.embedding, seed=80),
    Case("unembed", "unembed", _unembed, unembed, reference.unembed, seed=90),
    Case("route", "route", _route_case, _route_weights,
         lambda x, w, **o: reference.route(x, w, **o)[0], seed=100),
    Case("moe", "moe", _moe_case, _moe_call, _moe_reference, seed=110),
    Case("route(sigmoid)", "route", _route_sigmoid_case, _route_weights,
         lambda x, w, **o: reference.route(x, w, **o)[0], seed=115),
    Case("moe(sigmoid)", "moe", _moe_case, _moe_sigmoid_call, _moe_sigmoid_reference, seed=120),
    Case("rms_norm(no weight)", "rms_norm", _l2_norm_case, rms_norm, reference.rms_norm,
         seed=125),
])  # fmt: skip


# -- sampling: the log-probabilities sample() draws from, in float32 (float64 for float64) ----

_LOGITS = (2, 5, 257)  # (B, L, V)


def _logprobs_case(**options: Any) -> Callable[[int, str, str], Inputs]:
    def build(seed: int, dtype: str, backend: str) -> Inputs:
        return _inputs(random_array(seed, _LOGITS, dtype, backend=backend, scale=3.0), **options)

    return build


def _logprobs_reference(logits: np.ndarray, **options: Any) -> np.ndarray:
    with np.errstate(divide="ignore"):  # a token the filters removed: log 0 = -inf
        return np.log(reference.sampling_probs(logits, **options))


def _compute_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


CASES.extend([
    Case("logprobs", "logprobs", _logprobs_case(temperature=0.7),
         lambda z, *, impl, **o: logprobs(z, **o), _logprobs_reference, seed=170,
         out_dtype=_compute_dtype),
    Case("logprobs+top_k", "logprobs", _logprobs_case(temperature=0.7, top_k=20),
         lambda z, *, impl, **o: logprobs(z, **o), _logprobs_reference, seed=180,
         out_dtype=_compute_dtype),
])  # fmt: skip


# -- attention: scaled dot-product attention (direct, tiled) and the attention block ----------

_Q, _KV = (2, 4, 6, 16), (2, 2, 6, 16)  # (B, H, L, D), (B, H_kv, S, D): GQA, L == S
# L * S = 2**20 scores: auto takes the tiled path where no native kernel applies.
_Q_LONG, _KV_LONG = (1, 2, 1024, 8), (1, 1, 1024, 8)


def _sdpa_case(q_shape: tuple[int, ...] = _Q, kv_shape: tuple[int, ...] = _KV,
               **options: Any) -> Callable[[int, str, str], Inputs]:  # fmt: skip
    def build(seed: int, dtype: str, backend: str) -> Inputs:
        q = random_array(seed, q_shape, dtype, backend=backend)
        k = random_array(seed + 1, kv_shape, dtype, backend=backend)
        v = random_array(seed + 2, kv_shape, dtype, backend=backend)
        return _inputs(q, k, v, **options)

    return build


_BLOCK = (2, 5, 64, 4, 2, 16)  # (B, L, E, H, H_kv, D)


def _attention_case(seed: int, dtype: str, backend: str) -> Inputs:
    b, L, e, h, h_kv, d = _BLOCK
    shapes = [(h * d, e), (h_kv * d, e), (h_kv * d, e), (e, h * d)]
    x = random_array(seed, (b, L, e), dtype, backend=backend)
    ws = [random_weight(seed + 1 + i, s, dtype, backend=backend) for i, s in enumerate(shapes)]
    bs = [random_array(seed + 5 + i, (s[0],), dtype, backend=backend, scale=0.1)
          for i, s in enumerate(shapes[:3])]  # fmt: skip
    norms = [random_array(seed + 8 + i, (d,), dtype, backend=backend, low=0.5, high=1.5)
             for i in range(2)]  # fmt: skip
    return _inputs(x, *ws, *bs, *norms, offset=3)


def _attention_call(x: Any, wq: Any, wk: Any, wv: Any, wo: Any, bq: Any, bk: Any, bv: Any,
                    qn: Any, kn: Any, *, impl: str, offset: int = 0,
                    cache: KVCache | None = None) -> Any:  # fmt: skip
    return attention(x, wq=wq, wk=wk, wv=wv, wo=wo, bq=bq, bk=bk, bv=bv, q_norm=qn, k_norm=kn,
                     num_heads=_BLOCK[3], num_kv_heads=_BLOCK[4], rope={"base": 1e6},
                     offset=offset, cache=cache, impl=impl)  # fmt: skip


def _attention_reference(x: Any, wq: Any, wk: Any, wv: Any, wo: Any, bq: Any, bk: Any, bv: Any,
                         qn: Any, kn: Any, *, offset: int) -> np.ndarray:  # fmt: skip
    return reference.attention(x, wq, wk, wv, wo, _BLOCK[3], _BLOCK[4], bq=bq, bk=bk, bv=bv,
                               q_norm=qn, k_norm=kn, rope_options={"base": 1e6},
                               offset=offset)  # fmt: skip


# Llama 4's RoPE layers: interleaved RoPE, the weightless q/k norm after it, chunks of 2.
_LLAMA4: dict[str, Any] = {"chunk": 2, "qk_l2_norm": True}
_LLAMA4_ROPE = {"base": 5e5, "traditional": True}


def _llama4_attention_call(x: Any, wq: Any, wk: Any, wv: Any, wo: Any, bq: Any, bk: Any, bv: Any,
                           qn: Any, kn: Any, *, impl: str, offset: int = 0) -> Any:  # fmt: skip
    return attention(x, wq=wq, wk=wk, wv=wv, wo=wo, num_heads=_BLOCK[3], num_kv_heads=_BLOCK[4],
                     rope=_LLAMA4_ROPE, norm_eps=1e-5, impl=impl, **_LLAMA4)  # fmt: skip


def _llama4_attention_reference(
    x: Any, wq: Any, wk: Any, wv: Any, wo: Any, bq: Any, bk: Any, bv: Any, qn: Any, kn: Any, *,
    offset: int,
) -> np.ndarray:  # fmt: skip
    return reference.attention(x, wq, wk, wv, wo, _BLOCK[3], _BLOCK[4], norm_eps=1e-5,
                               rope_options=_LLAMA4_ROPE, **_LLAMA4)  # fmt: skip


# Decoding through a KVCache: a prefill chunk of _PREFILL tokens, then one token at a time.
_PREFILL = 3


def _decode_case(seed: int, dtype: str, backend: str) -> Inputs:
    return replace(_attention_case(seed, dtype, backend), options={"prefill": _PREFILL})


def _decode_call(x: Any, *weights: Any, impl: str, prefill: int) -> Any:
    bk = backend_of(x)
    assert bk is not None
    cache = KVCache(static_shapes=bk.static_shapes)  # as Model.make_cache
    chunks = [x[:, :prefill, :], *(x[:, i : i + 1, :] for i in range(prefill, x.shape[1]))]
    outs = [_attention_call(c, *weights, impl=impl, cache=cache) for c in chunks]
    return bk.xp.concat(outs, axis=1)  # (B, L, E)


def _decode_reference(*refs: np.ndarray, prefill: int) -> np.ndarray:
    return _attention_reference(*refs, offset=0)  # the whole sequence in one causal forward


CASES.extend([
    Case("sdpa", "scaled_dot_product_attention", _sdpa_case(mask="causal"),
         scaled_dot_product_attention, reference.scaled_dot_product_attention, seed=120),
    Case("sdpa+window", "scaled_dot_product_attention", _sdpa_case(window=3),
         scaled_dot_product_attention, reference.scaled_dot_product_attention, seed=130),
    Case("sdpa+softcap", "scaled_dot_product_attention", _sdpa_case(mask="causal", softcap=5.0),
         scaled_dot_product_attention, reference.scaled_dot_product_attention, seed=140),
    Case("sdpa long", "scaled_dot_product_attention",
         _sdpa_case(_Q_LONG, _KV_LONG, mask="causal"), scaled_dot_product_attention,
         reference.scaled_dot_product_attention, seed=150),
    Case("attention", "attention", _attention_case, _attention_call, _attention_reference,
         seed=160),
    Case("attention+cache", "attention", _decode_case, _decode_call, _decode_reference, seed=190),
    Case("attention(llama4)", "attention", _attention_case, _llama4_attention_call,
         _llama4_attention_reference, seed=195),
])  # fmt: skip


# -- issue 31's blocks: gpt-oss's attention sinks and clamped SwiGLU, DeepSeek V3's router ------

_GROUPED = {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True}
_SWIGLU = {"limit": 2.0, "alpha": 1.702}  # a limit inside the inputs' [-3, 3]: it clamps


def _sinks_case(seed: int, dtype: str, backend: str) -> Inputs:
    qkv = [random_array(seed + j, shape, dtype, backend=backend)
           for j, shape in enumerate((_Q, _KV, _KV))]  # fmt: skip
    sinks = random_array(seed + 3, (_Q[1],), dtype, backend=backend)
    return _inputs(*qkv, sinks, mask="causal")


def _swiglu_case(seed: int, dtype: str, backend: str) -> Inputs:
    gate, up = (random_array(seed + j, (*_X[:-1], 160), dtype, backend=backend) for j in (0, 1))
    return _inputs(gate, up, **_SWIGLU)


def _bias(seed: int, backend: str) -> tuple[Any, np.ndarray]:
    """An e_score_correction_bias ``(X,)`` (float32, as HF keeps it)."""
    return random_array(seed, (_EXPERTS,), "float32", backend=backend, low=-0.2, high=0.2)


def _route_grouped_case(seed: int, dtype: str, backend: str) -> Inputs:
    return _inputs(*_router(seed, dtype, backend), _bias(seed + 9, backend), top_k=_TOP_K,
                   router="grouped", **_GROUPED)  # fmt: skip


def _moe_grouped_case(seed: int, dtype: str, backend: str) -> Inputs:
    c = _moe_case(seed, dtype, backend)
    bias = _bias(seed + 9, backend)
    return Inputs((*c.arrays, bias[0]), (*c.refs, bias[1]), {"top_k": _TOP_K, **_GROUPED})


def _moe_grouped_call(x: Any, w: Any, g: Any, u: Any, d: Any, sg: Any, su: Any, sd: Any,
                      sgate: Any, b: Any, **options: Any) -> Any:  # fmt: skip
    return moe(x, w, g, u, d, shared=(sg, su, sd), shared_gate=sgate, router="grouped",
               e_score_correction_bias=b, **options)  # fmt: skip


def _moe_grouped_reference(x: Any, w: Any, g: Any, u: Any, d: Any, sg: Any, su: Any, sd: Any,
                           sgate: Any, b: Any, **options: Any) -> np.ndarray:  # fmt: skip
    return reference.moe(x, w, g, u, d, shared=(sg, su, sd), shared_gate=sgate,
                         router="grouped", e_score_correction_bias=b, **options)  # fmt: skip


def _moe_swiglu_call(*arrays: Any, **options: Any) -> Any:
    return _moe_call(*arrays, swiglu_limit=_SWIGLU["limit"], swiglu_alpha=_SWIGLU["alpha"],
                     **options)  # fmt: skip


def _moe_swiglu_reference(x: Any, w: Any, g: Any, u: Any, d: Any, sg: Any, su: Any, sd: Any,
                          sgate: Any, **options: Any) -> np.ndarray:  # fmt: skip
    return reference.moe(x, w, g, u, d, shared=(sg, su, sd), shared_gate=sgate,
                         swiglu=(_SWIGLU["limit"], _SWIGLU["alpha"]), **options)  # fmt: skip


CASES.extend([
    Case("sdpa+sinks", "scaled_dot_product_attention", _sinks_case,
         lambda q, k, v, s, **o: scaled_dot_product_attention(q, k, v, sinks=s, **o),
         lambda q, k, v, s, **o: reference.scaled_dot_product_attention(q, k, v, sinks=s, **o),
         seed=196),
    Case("clamped_swiglu", "clamped_swiglu", _swiglu_case, clamped_swiglu,
         reference.clamped_swiglu, seed=197),
    Case("moe(clamped swiglu)", "moe", _moe_case, _moe_swiglu_call, _moe_swiglu_reference,
         seed=198),
    Case("route(grouped)", "route", _route_grouped_case,
         lambda x, w, b, **o: _route_weights(x, w, e_score_correction_bias=b, **o),
         lambda x, w, b, **o: reference.route(x, w, e_score_correction_bias=b, **o)[0],
         seed=199),
    Case("moe(grouped)", "moe", _moe_grouped_case, _moe_grouped_call, _moe_grouped_reference,
         seed=200),
])  # fmt: skip


# -- the recurrent blocks: a short convolution, the gated delta rule, the Mamba-2 scan ----------
# Each returns (out, state); the row checks out, from a state, over chunks of 2 (chunked form).


def _conv_case(seed: int, dtype: str, backend: str) -> Inputs:
    B, L, C, K = 2, 5, 64, 4
    shapes = [(B, L, C), (C, K), (C,), (B, K - 1, C)]
    return _inputs(*(random_array(seed + j, s, dtype, backend=backend)
                     for j, s in enumerate(shapes)), activation="silu")  # fmt: skip


def _delta_case(seed: int, dtype: str, backend: str) -> Inputs:
    B, L, h_k, H, d = 2, 5, 2, 4, 16
    kw: dict[str, Any] = {"backend": backend}
    return _inputs(
        random_array(seed, (B, L, h_k, d), dtype, **kw),
        random_array(seed + 1, (B, L, h_k, d), dtype, **kw),
        random_array(seed + 2, (B, L, H, d), dtype, **kw),
        random_array(seed + 3, (B, L, H), dtype, **kw, low=-1.0, high=0.0),
        random_array(seed + 4, (B, L, H), dtype, **kw, low=0.0, high=1.0),
        random_array(seed + 5, (B, H, d, d), "float32", **kw),
        qk_l2_norm=True,
    )


def _ssd_case(seed: int, dtype: str, backend: str) -> Inputs:
    B, L, G, H, P, N = 2, 5, 2, 4, 8, 16
    kw: dict[str, Any] = {"backend": backend}
    return _inputs(
        random_array(seed, (B, L, H, P), dtype, **kw),
        random_array(seed + 1, (B, L, H), dtype, **kw),
        random_array(seed + 2, (H,), "float32", **kw, low=-2.0, high=-0.5),
        random_array(seed + 3, (B, L, G, N), dtype, **kw, scale=1 / 3),
        random_array(seed + 4, (B, L, G, N), dtype, **kw, scale=1 / 3),
        random_array(seed + 5, (H,), "float32", **kw),
        random_array(seed + 6, (B, L, H, P), dtype, **kw),
        random_array(seed + 7, (H,), "float32", **kw, scale=1 / 3),
        random_array(seed + 8, (B, H, P, N), "float32", **kw),
    )


def _gated_norm_case(seed: int, dtype: str, backend: str) -> Inputs:
    kw: dict[str, Any] = {"backend": backend}
    return _inputs(
        random_array(seed, _X, dtype, **kw),
        random_array(seed + 1, _X, dtype, **kw),
        random_array(seed + 2, _X[-1:], dtype, **kw),
        n_groups=4,
        norm_before_gate=False,
    )


CASES.extend([
    Case("gated_rms_norm", "gated_rms_norm", _gated_norm_case,
         lambda x, g, w, **o: gated_rms_norm(x, g, w, **o),
         lambda x, g, w, n_groups, norm_before_gate: reference.gated_rms_norm(
             x, g, w, 1e-6, n_groups, norm_before_gate), seed=225),
    Case("short_conv", "short_conv", _conv_case,
         lambda x, w, b, s, **o: short_conv(x, w, bias=b, state=s, **o)[0],
         lambda x, w, b, s, **o: reference.short_conv(x, w, b, s, **o)[0], seed=230),
    Case("gated_delta_rule", "gated_delta_rule", _delta_case,
         lambda *a, **o: gated_delta_rule(*a[:5], state=a[5], chunk_size=2, **o)[0],
         lambda *a, **o: reference.gated_delta_rule(*a, **o)[0], seed=240),
    Case("ssd_scan", "ssd_scan", _ssd_case,
         lambda x, dt, A, B, C, D, z, b, s, **o: ssd_scan(
             x, dt, A, B, C, D=D, z=z, dt_bias=b, state=s, chunk_size=2, **o)[0],
         lambda x, dt, A, B, C, D, z, b, s: reference.ssd_scan(
             x, dt, A, B, C, D=D, z=z, dt_bias=b, state=s)[0], seed=250),
])  # fmt: skip


# -- multi-head latent attention (DeepSeek V3, Kimi K2): both forms, the latent cache ----------

# A DeepSeek V3 layer's shape, scaled down: a query LoRA, d_v != d_n + d_r
_LATENT = {
    "hidden_size": _X[-1],
    "num_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "out_size": _X[-1],
}
_LATENT_DIMS: dict[str, Any] = {n: _LATENT[n] for n in LATENT_DIMS}
_LATENT_NAMES = ("wkv_a", "kv_a_norm", "wkv_b", "wo", "wq_a", "q_a_norm", "wq_b")  # fmt: skip


def _latent_case(form: str, prefill: int | None = None) -> Callable[[int, str, str], Inputs]:
    def build(seed: int, dtype: str, backend: str) -> Inputs:
        x = random_array(seed, _X, dtype, backend=backend)
        arrays, refs = random_latent_layer(seed + 1, _LATENT, dtype, backend=backend)
        assert tuple(arrays) == _LATENT_NAMES
        options: dict[str, Any] = {"form": form, "prefill": prefill}
        return Inputs((x[0], *arrays.values()), (x[1], *refs.values()), options)

    return build


def _latent_call(x: Any, *weights: Any, impl: str, form: str, prefill: int | None) -> Any:
    kw = {**dict(zip(_LATENT_NAMES, weights, strict=True)), **_LATENT_DIMS}
    if prefill is None:
        return latent_attention(x, **kw, form=form, impl=impl)
    bk = backend_of(x)
    assert bk is not None
    cache = KVCache(static_shapes=bk.static_shapes)  # the latent cache, as Model.make_cache
    chunks = [x[:, :prefill, :], *(x[:, i : i + 1, :] for i in range(prefill, x.shape[1]))]
    outs = [latent_attention(c, **kw, cache=cache, form=form, impl=impl) for c in chunks]
    return bk.xp.concat(outs, axis=1)  # (B, L, E)


def _latent_reference(x: Any, *weights: Any, form: str, prefill: int | None) -> np.ndarray:
    kw = dict(zip(_LATENT_NAMES, weights, strict=True))
    return reference.latent_attention(x, **kw, **_LATENT_DIMS)  # one causal forward


CASES.extend([
    Case("latent_attention", "latent_attention", _latent_case("expanded"), _latent_call,
         _latent_reference, seed=201),
    Case("latent_attention(absorbed)", "latent_attention", _latent_case("absorbed"),
         _latent_call, _latent_reference, seed=202),
    Case("latent_attention+cache", "latent_attention", _latent_case("absorbed", _PREFILL),
         _latent_call, _latent_reference, seed=203),
])  # fmt: skip


# -- paged attention: decode over keys in a pool's pages, read through block tables -----------

_PAGED = (8, 2, 4, 8)  # H, H_kv, page size P, D
_PAGED_LENS = (7, 13, 4)  # unequal rows: a partial page, several pages, less than a page


def _paged_case(seed: int, dtype: str, backend: str) -> Inputs:
    H, h_kv, P, D = _PAGED
    need = [-(-n // P) for n in _PAGED_LENS]
    N = 2 * sum(need) + 1  # half the pool free: auto gathers (the pool-wide path pays when full)
    order = np.random.default_rng(seed).permutation(N).astype(np.int32)
    tables = np.zeros((len(need), max(need)), dtype=np.int32)  # pages in a shuffled order
    for b, n in enumerate(need):
        tables[b, :n], order = order[:n], order[n:]
    lens = np.asarray(_PAGED_LENS, dtype=np.int32)
    q = random_array(seed, (len(need), H, 1, D), dtype, backend=backend)
    k = random_array(seed + 1, (N, h_kv, P, D), dtype, backend=backend)
    v = random_array(seed + 2, (N, h_kv, P, D), dtype, backend=backend)
    ids = [(asarray(a, backend=backend), a) for a in (tables, lens)]
    return _inputs(q, k, v, *ids)


def _paged_call(q: Any, k: Any, v: Any, tables: Any, lens: Any, *, impl: str) -> Any:
    pool = SimpleNamespace(k_pages=k, v_pages=v)  # paged_attention reads only the pages
    return paged_attention(q, pool, tables, lens, impl=impl)


def _paged_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, tables: np.ndarray, lens: np.ndarray
) -> np.ndarray:
    """Each row alone: dense causal attention over its keys, gathered in order."""
    rows = []
    for b, n in enumerate(lens.tolist()):
        pages = tables[b, : -(-n // k.shape[2])]
        kb, vb = (np.concatenate(list(a[pages]), axis=1)[None, :, :n] for a in (k, v))
        rows.append(reference.scaled_dot_product_attention(q[b : b + 1], kb, vb, mask="causal"))
    return np.concatenate(rows, axis=0)


CASES.append(
    Case("paged_attention", "paged_attention", _paged_case, _paged_call, _paged_reference, seed=220)
)


# -- quantized weights (MLX's affine layout): dequantize and the quantized matmul --------------

_QBITS, _QGROUP = 4, 32


def _quantized(seed: int, dtype: str, backend: str) -> Inputs:
    """x and a weight quantized on the backend; the references are the float64 copies of the
    very packed codes, scales and biases the call gets."""
    bk = get_backend(backend)
    w, _ = random_weight(seed + 1, (48, _X[-1]), dtype, backend=backend)
    qw = quantize(w, bits=_QBITS, group_size=_QGROUP)
    parts = [(a, bk.to_numpy(a).astype(np.float64)) for a in (qw.scales, qw.biases)]
    packed = (qw.packed, bk.to_numpy(qw.packed))
    x = random_array(seed, _X, dtype, backend=backend)
    return _inputs(x, packed, *parts, bits=_QBITS, group_size=_QGROUP)


def _quantized_linear_call(x: Any, p: Any, s: Any, b: Any, *, impl: str, **fmt: Any) -> Any:
    return quantized_linear(x, QuantizedWeight(p, s, b, **fmt), impl=impl)


def _dequantize_call(x: Any, p: Any, s: Any, b: Any, *, impl: str, **fmt: Any) -> Any:
    return dequantize(QuantizedWeight(p, s, b, **fmt), impl=impl)


def _dequantize_reference(x: Any, p: Any, s: Any, b: Any, **fmt: Any) -> np.ndarray:
    return reference.dequantize(p, s, b, **fmt)


def _quantized_linear_reference(x: Any, p: Any, s: Any, b: Any, **fmt: Any) -> np.ndarray:
    return reference.quantized_linear(x, p, s, b, **fmt)


CASES.extend([
    Case("dequantize", "dequantize", _quantized, _dequantize_call, _dequantize_reference,
         seed=200),
    Case("quantized_linear", "quantized_linear", _quantized, _quantized_linear_call,
         _quantized_linear_reference, seed=210),
])  # fmt: skip


# -- MXFP4 (gpt-oss's experts): FP4 E2M1 codes, an E8M0 scale per 32 -----------------------------


def _mxfp4(seed: int, dtype: str, backend: str) -> Inputs:
    """x and random codes and exponents (weights of 2**-9 .. 2**-3 times E2M1's values: O(1)
    products); the references read the very words and exponents the call gets."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (48, _X[-1])).astype(np.uint32)
    shifts = (4 * np.arange(8)).astype(np.uint32)
    packed = (codes.reshape(48, -1, 8) << shifts).sum(-1, dtype=np.uint32)  # (48, E / 8)
    e = rng.integers(118, 124, (48, _X[-1] // 32)).astype(np.uint8)
    x = random_array(seed, _X, dtype, backend=backend)
    arrays = [(asarray(a, backend=backend), a) for a in (packed, e)]
    return _inputs(x, *arrays, dtype=dtype)


def _mxfp4_weight(p: Any, e: Any, dtype: str) -> MXFP4Weight:
    return MXFP4Weight(p, e, dtype=dtype)


CASES.extend([
    Case("dequantize(mxfp4)", "dequantize_mxfp4", _mxfp4,
         lambda x, p, e, *, impl, dtype: dequantize(_mxfp4_weight(p, e, dtype), impl=impl),
         lambda x, p, e, *, dtype: reference.mxfp4_dequantize(p, e), seed=215),
    Case("quantized_linear(mxfp4)", "quantized_linear_mxfp4", _mxfp4,
         lambda x, p, e, *, impl, dtype: quantized_linear(x, _mxfp4_weight(p, e, dtype),
                                                          impl=impl),
         lambda x, p, e, *, dtype: reference.mxfp4_linear(x, p, e), seed=216),
])  # fmt: skip


# gpt-oss's block over MXFP4 experts kept quantized (moe_experts_mxfp4): the router's bias, the
# experts' biases, the clamped SwiGLU; the reference multiplies the codes' float64 values.
def _moe_mxfp4_case(seed: int, dtype: str, backend: str) -> Inputs:
    rng = np.random.default_rng(seed)
    e, i = _X[-1], 32
    experts = []
    for rows, cols in ((i, e), (i, e), (e, i)):  # gate, up (X, I, E); down (X, E, I)
        codes = rng.integers(0, 16, (_EXPERTS, rows, cols)).astype(np.uint32)
        shifts = (4 * np.arange(8)).astype(np.uint32)
        packed = (codes.reshape(_EXPERTS, rows, -1, 8) << shifts).sum(-1, dtype=np.uint32)
        scales = rng.integers(120, 123, (_EXPERTS, rows, cols // 32)).astype(np.uint8)
        experts += [(asarray(a, backend=backend), a) for a in (packed, scales)]
    biases = [random_array(seed + 5 + j, shape, dtype, backend=backend, low=-0.5, high=0.5)
              for j, shape in enumerate(((_EXPERTS, i), (_EXPERTS, i), (_EXPERTS, e)))]  # fmt: skip
    return _inputs(*_router(seed, dtype, backend, biased=True), *experts, *biases,
                   top_k=_TOP_K, norm_topk_prob=True, dtype=dtype)  # fmt: skip


def _moe_mxfp4_call(x: Any, w: Any, b: Any, *arrays: Any, dtype: str, **options: Any) -> Any:
    q = [_mxfp4_weight(arrays[j], arrays[j + 1], dtype) for j in (0, 2, 4)]
    return moe(x, w, *q, router_bias=b, experts_gate_bias=arrays[6], experts_up_bias=arrays[7],
               experts_down_bias=arrays[8], swiglu_limit=_SWIGLU["limit"],
               swiglu_alpha=_SWIGLU["alpha"], **options)  # fmt: skip


def _moe_mxfp4_reference(x: Any, w: Any, b: Any, *arrays: Any, dtype: str,
                         **options: Any) -> np.ndarray:  # fmt: skip
    q = [reference.mxfp4_dequantize(arrays[j], arrays[j + 1]) for j in (0, 2, 4)]
    return reference.moe(x, w, *q, router_bias=b, experts_biases=tuple(arrays[6:]),
                         swiglu=(_SWIGLU["limit"], _SWIGLU["alpha"]), **options)  # fmt: skip


CASES.append(
    Case("moe(gpt-oss, mxfp4 experts)", "moe_experts_mxfp4", _moe_mxfp4_case, _moe_mxfp4_call,
         _moe_mxfp4_reference, seed=217)
)  # fmt: skip


# -- the kernels a loaded model binds once (decoder.layer_weights.bind_weight) ------------------
# A model binds each projection at load: packed into the backend's layout (``pack_linear``:
# oneDNN's for bfloat16 on torch's CPU, where the CPU runs it) or a quantized weight with its
# kernel specialized for that weight (torch's int4 repack). These rows bind a weight the same
# way and run it as the prepared forward runs it, so the report fails where a loaded model
# would (an AVX2-only CPU once raised inside oneDNN's bfloat16 packing, which no op row ran).


def _bound(x: Any, w: Any, b: Any) -> Any:
    """``w`` bound as a model binds it, run on ``x`` as the prepared forward runs it; the
    kernel that ran is added to the open trace (a bound call skips the dispatcher)."""
    bk = backend_of(x)
    assert bk is not None  # the case's arrays are a backend's
    d = dispatcher(bk)
    bound = bind_weight(d, w)
    if isinstance(bound, Packed):
        out = bound(bk.xp, x, b)
        replay([TraceEntry("packed_linear", bk.name, *d.label(bound.fn))])
        return out
    if isinstance(bound, QLinear):
        out = bound(bk.xp, x, b)
        chosen, _ = bound.fns[(*x.shape[:-1], x.dtype, b is None)]
        impl, kernel = d.label(chosen)
        arrays, fmt = w.arrays, {"bits": w.bits, "group_size": w.group_size}
        if d.specialized("quantized_linear", chosen, x, *arrays, b, **fmt) is not None:
            kernel += " (specialized for the bound weight)"
        replay([TraceEntry("quantized_linear", bk.name, impl, kernel)])
        return out
    return linear(x, bound, b)


def _bound_linear_call(x: Any, w: Any, b: Any = None, *, impl: str) -> Any:
    return _bound(x, w, b) if impl == "auto" else linear(x, w, b, impl=impl)


def _bound_quantized_call(x: Any, p: Any, s: Any, b: Any, *, impl: str, **fmt: Any) -> Any:
    qw = QuantizedWeight(p, s, b, **fmt)
    return _bound(x, qw, None) if impl == "auto" else quantized_linear(x, qw, impl=impl)


CASES.extend([
    Case("bound linear", "linear", _linear(True), _bound_linear_call, reference.linear,
         seed=40),
    Case("bound quantized_linear", "quantized_linear", _quantized, _bound_quantized_call,
         _quantized_linear_reference, seed=220),
])  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One line of the table: a case on one backend, dtype and ``impl``."""

    case: str
    dtype: str
    impl: str
    path: str
    tol: Tolerance
    max_abs: float | None = None
    max_rel: float | None = None
    #: max |actual - desired| / (atol + rtol * |desired|): the row is within tolerance when <= 1.
    err_tol: float | None = None
    result: str = "ok"  # "ok", "FAIL" or "ERROR"
    detail: str = ""
    #: The path column's short form: "native", "portable", "tiled", "native+portable", ...
    short: str = ""


def short_path(entries: Sequence[TraceEntry]) -> str:
    """The path column of the table: the impls that ran (``"native"`` for every native kernel),
    in call order, without repeats: ``"native"``, ``"portable"``, ``"tiled"``,
    ``"native+portable"``. The kernels are listed under the table."""
    impls = dict.fromkeys(e.impl for e in entries)
    return "+".join(impls) if impls else "-"


def path_of(bk: Backend, entries: Sequence[TraceEntry]) -> tuple[str, bool]:
    """The path column for what one call recorded in a :func:`~portable_llm.trace`, and whether
    any native kernel ran."""
    d = dispatcher(bk)
    parts: list[tuple[str, str]] = []
    for e in entries:
        nat = d.native.get(e.op)
        if e.impl == "native":
            parts.append((e.op, e.kernel))
        elif nat is None:
            parts.append((e.op, e.impl))
        else:
            parts.append((e.op, f"{e.impl} ({nat.kernel} not taken by auto)"))
    used = any(e.impl == "native" for e in entries)
    parts = list(dict.fromkeys(parts))  # an op called again on the same path is named once
    if not parts:
        return "-", used
    if len(parts) == 1:
        return parts[0][1], used
    if not used and all(k == "portable" for _, k in parts):
        return "portable", used
    return " + ".join(f"{op}: {k}" for op, k in parts), used


def _check(bk: Backend, case: Case, dtype: str, impl: str, path: str, inputs: Inputs) -> Row:
    out = case.out_dtype(dtype) if case.out_dtype else dtype
    tol = tolerance(out, bk.name)  # the one assert_close applies
    row = Row(case.name, dtype, impl, path, tol)
    try:
        desired = case.reference(*inputs.refs, **inputs.options)
        actual = case.call(*inputs.arrays, impl=impl, **inputs.options)
    except Exception as exc:  # a crash is reported as a row, not a traceback
        return replace(row, result="ERROR", detail=f"{type(exc).__name__}: {exc}")
    if tuple(actual.shape) == np.shape(desired):
        got = to_numpy(actual)
        errors = compare_values(got, desired, tol.rtol, tol.atol)
        ratio = _err_tol(got, desired, tol)
        row = replace(row, max_abs=errors.max_abs, max_rel=errors.max_rel, err_tol=ratio)
    try:
        assert_close(actual, desired, backend=bk.name, dtype=out)
    except AssertionError as exc:
        return replace(row, result="FAIL", detail=str(exc))
    return row


def _err_tol(actual: np.ndarray, desired: np.ndarray, tol: Tolerance) -> float:
    """max ``|actual - desired| / (atol + rtol |desired|)`` over the finite elements (NaN and
    infinities are checked by position in :func:`~portable_llm.testing.assert_close`)."""
    a, d = actual.astype(np.float64), np.asarray(desired, np.float64)
    finite = np.isfinite(a) & np.isfinite(d)
    if not finite.any():
        return 0.0
    a, d = a[finite], d[finite]
    return float((np.abs(a - d) / (tol.atol + tol.rtol * np.abs(d))).max())


def check_case(bk: Backend, case: Case, dtype: str) -> list[Row]:
    """The rows of one case on one backend and dtype: ``auto``, then the path it did not take.

    The path column is what the dispatcher recorded while ``auto`` ran (:func:`portable_llm.trace`).
    ``portable`` follows when ``auto`` ran a native kernel; ``native`` when the call goes
    through one op whose native kernel ``auto`` passed over (its ``prefer`` or dtype rule) and
    that kernel can compute these arguments.
    """
    inputs = case.build(case.seed, dtype, bk.name)
    with trace() as t:
        auto = _check(bk, case, dtype, "auto", "", inputs)
    # Entries of an implementation's own pieces ("scaled_dot_product_attention.tiled") are
    # part of the impl that called them.
    entries = [e for e in t if e.backend == bk.name and "." not in e.op]
    path, native_ran = path_of(bk, entries)
    rows = [replace(auto, path=path, short=short_path(entries))]
    if native_ran:
        rows.append(replace(_check(bk, case, dtype, "portable", "portable", inputs),
                            short="portable"))  # fmt: skip
        return rows
    ops = {e.op for e in t}
    nat = dispatcher(bk).native.get(case.op) if ops == {case.op} else None
    if nat is not None:
        row = replace(_check(bk, case, dtype, "native", nat.kernel, inputs), short="native")
        if not (row.result == "ERROR" and "cannot express" in row.detail):
            rows.append(row)
    return rows


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain-text table: left-aligned columns separated by two spaces, a rule under the header."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [headers, ["-" * w for w in widths], *rows]
    ]
    return "\n".join(lines)


def _select(cases: Sequence[Case], ops: Sequence[str] | None) -> list[Case]:
    if not ops:
        return list(cases)
    known = {c.op for c in cases} | {c.name for c in cases}
    unknown = [o for o in ops if o not in known]
    if unknown:
        names = ", ".join(sorted(known))
        raise UsageError(f"--op: unknown op(s) {', '.join(unknown)}; known: {names}")
    return [c for c in cases if c.op in ops or c.name in ops]


def backend_names(names: Sequence[str] | None) -> list[str]:
    """The canonical backend names selected by ``--backend`` (all known ones when empty)."""
    if not names:
        return list(BACKENDS)
    picked = set()
    for n in names:
        try:
            picked.add(backend_name(n))
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"--backend: {exc}") from None
    return [b for b in BACKENDS if b in picked]


def load(name: str, file: TextIO, *, x64: bool = True) -> Backend | None:
    """The backend, or ``None`` after printing why it is skipped (its library is missing).

    ``x64``: make float64 available where the library needs a switch for it
    (:meth:`Backend.enable_float64`: JAX's process-wide ``jax_enable_x64``).
    """
    try:
        bk = get_backend(name)
    except BackendNotInstalledError as exc:
        print(wrap(f"== {name}: skipped, not installed ({exc})") + "\n", file=file)
        return None
    had_float64 = "float64" in bk.float_dtypes()
    if x64:  # float64 rows need it
        bk.enable_float64()
    dev = bk.device(None)
    dev = dev if dev is not None else bk.device_of(bk.xp.asarray(0.0))
    print(f"== {name} {bk.version}, default device {dev}", file=file, flush=True)
    if not had_float64 and "float64" in bk.float_dtypes():
        print(f"   (float64 turned on for this process, so it runs on {name})", file=file)
    return bk


def load_for_dtype(name: str, dtype: str, file: TextIO) -> Backend | None:
    """:func:`load` (JAX without x64) for a benchmark in ``dtype``; ``None`` after printing why
    the backend is skipped (not installed, or ``dtype`` is not among its float dtypes)."""
    bk = load(name, file, x64=False)
    if bk is not None and dtype not in bk.float_dtypes():
        dtypes = ", ".join(bk.float_dtypes())
        print(wrap(f"   skipped: no {dtype} on {name} ({dtypes})", hang="     "), file=file)
        return None
    return bk


_HEADERS = ("op", "dtype", "impl", "path", "max abs err", "err/tol", "result")
_COLUMNS = (
    "   err = |out - float64 ref|; max abs err = max err; "
    "err/tol = max err/(atol + rtol |ref|), ok <= 1"
)


def _cells(row: Row) -> list[str]:
    err = "-" if row.max_abs is None else f"{row.max_abs:.2e}"
    ratio = "-" if row.err_tol is None else f"{row.err_tol:.2f}"
    return [row.case, row.dtype, row.impl, row.short or row.path, err, ratio, row.result]


# The default report: one line per op (case) and backend; -v prints the rows above instead.
_SUMMARY = ("op", "dtypes", "auto ran", "err/tol", "result")
_SUMMARY_COLUMNS = (
    "   err/tol = max |out - float64 ref|/(atol + rtol |ref|) over the dtypes and paths, ok <= 1"
    "\n   (-v: a row per dtype and path, the tolerances, the kernels behind each path)"
)
_SHORT_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


def _summary_cells(rows: Sequence[Row]) -> list[str]:
    """One case's rows on one backend as one line: its dtypes, the paths ``auto`` took (in
    dtype order, without repeats), the worst err/tol and the worst result."""
    dtypes = dict.fromkeys(_SHORT_DTYPES.get(r.dtype, r.dtype) for r in rows)
    paths = dict.fromkeys(r.short or r.path for r in rows if r.impl == "auto")
    ratios = [r.err_tol for r in rows if r.err_tol is not None]
    worst = next((w for w in ("ERROR", "FAIL") if any(r.result == w for r in rows)), "ok")
    ratio = f"{max(ratios):.2f}" if ratios else "-"
    return [rows[0].case, " ".join(dtypes), ", ".join(paths), ratio, worst]


def _wrap(text: str, indent: str, hang: str) -> list[str]:
    return wrap(text, indent, hang).split("\n")


def _notes(backend: str, rows: Sequence[Row]) -> list[str]:
    """The lines under a backend's table: tolerances, then the kernels behind the path column."""
    tols: dict[str, Tolerance] = {}
    for r in rows:
        tols.setdefault(r.dtype if r.tol is not BACKEND_TOLERANCES.get((backend, r.dtype))
                        else f"{r.dtype}*", r.tol)  # fmt: skip
    listed = ", ".join(f"{d} {t.rtol:g}/{t.atol:g}" for d, t in tols.items())
    lines = _wrap(f"tolerance (rtol/atol) by dtype: {listed}", "   ", "     ")
    # Cases whose result has another dtype than their inputs (logprobs: float32) are checked at
    # the tolerance of the result's dtype.
    others: dict[tuple[float, float], dict[str, list[str]]] = {}
    for r in rows:
        if r.tol is not tols.get(r.dtype) and r.tol is not tols.get(f"{r.dtype}*"):
            key = (r.tol.rtol, r.tol.atol)
            dts = others.setdefault(key, {}).setdefault(r.case, [])
            if r.dtype not in dts:
                dts.append(r.dtype)
    for (rtol, atol), by_case in others.items():
        names = ", ".join(dict.fromkeys(d for ds in by_case.values() for d in ds))
        text = f"{', '.join(by_case)} ({names}): {rtol:g}/{atol:g}, the tolerance of the result's"
        lines += _wrap(text + " dtype", "   ", "     ")
    for d in tols:
        if d.endswith("*"):
            why = BACKEND_TOLERANCES[(backend, d[:-1])].why
            lines += _wrap(f"* {d[:-1]} on {backend}: the backend's own tolerance. {why}",
                           "   ", "     ")  # fmt: skip
    # case -> full path -> dtypes, for the auto rows whose path names more than the column
    paths: dict[str, dict[str, list[str]]] = {}
    for r in rows:
        if r.impl == "auto" and r.path not in ("portable", "tiled", "-"):
            paths.setdefault(r.case, {}).setdefault(r.path, []).append(r.dtype)
    if paths:
        lines.append("   what auto ran (portable, tiled: portable_llm's own Array API code):")
        for case, by_path in paths.items():
            for path, dts in by_path.items():
                every = len(by_path) == 1
                label = case if every else f"{case} ({', '.join(dts)})"
                lines += _wrap(f"{label}: {path}", "     ", "         ")
    return lines


def run_report(
    backends: Sequence[str] | None = None,
    ops: Sequence[str] | None = None,
    dtypes: Sequence[str] | None = None,
    file: TextIO | None = None,
    *,
    verbose: bool = False,
) -> int:
    """Print the report; return 1 if any row is outside tolerance or raised, 0 otherwise.

    ``backends``, ``ops`` and ``dtypes`` select (default: all); a name that selects nothing
    known is a :class:`UsageError`. Per backend, one line per op (its dtypes, the paths
    ``auto`` took, the worst err/tol and result); ``verbose`` (``-v``): a row per dtype and
    path, then the tolerances and the kernels behind each path.
    """
    out = file if file is not None else sys.stdout
    cases, names = _select(CASES, ops), backend_names(backends)
    if dtypes and set(dtypes) - set(FLOAT_DTYPES):
        bad = ", ".join(sorted(set(dtypes) - set(FLOAT_DTYPES)))
        raise UsageError(f"--dtype: unknown dtype(s) {bad}; known: {', '.join(FLOAT_DTYPES)}")
    failed: list[tuple[str, Row]] = []
    skip: set[str] = set()
    if numpy_bfloat16() is None and (not dtypes or "bfloat16" in dtypes):
        skip.add("bfloat16")
        note = (
            "note: bfloat16 skipped on every backend: ml_dtypes is not installed, and the NumPy "
            f"reference needs it ({install_hint('bfloat16')})"
        )
        print(wrap(note) + "\n", file=out)
    for name in names:
        start = time.perf_counter()
        bk = load(name, out)
        if bk is None:
            continue
        run = [d for d in bk.float_dtypes() if (not dtypes or d in dtypes) and d not in skip]
        # each row (each op's line) is printed as it is checked, in columns sized in advance
        width = max(len(c.name) for c in cases)
        table = Table(_HEADERS, [width, 8, 8, 15]) if verbose else Table(_SUMMARY, [width, 16, 16])
        print((_COLUMNS if verbose else _SUMMARY_COLUMNS) + "\n" + table.header(), file=out)
        rows: list[Row] = []
        for case in cases:
            done = len(rows)
            with Phases("report")(f"checking {case.name} on {name}", announce=False):
                for dtype in run:
                    for row in check_case(bk, case, dtype):
                        if verbose:
                            print(table.row(_cells(row)), file=out, flush=True)
                        rows.append(row)
            if not verbose and rows[done:]:
                print(table.row(_summary_cells(rows[done:])), file=out, flush=True)
        print(file=out)
        if verbose:
            print("\n".join(_notes(name, rows)), file=out)
        outside = [r for r in rows if r.result != "ok"]
        verdict = f"{len(outside)} outside tolerance" if outside else "all ok"
        took = time.perf_counter() - start
        print(f"== {name}: {len(rows)} checks in {took:.1f} s, {verdict}\n", file=out, flush=True)
        failed.extend((name, r) for r in outside)
    for name, row in failed:  # wrapped, continuation lines indented by 4
        line = f"{row.result}: {name} {row.case} {row.dtype} impl={row.impl}: {row.detail}"
        print("\n".join(_wrap(line, "", "    ")), file=out)
    print(f"{len(failed)} row(s) outside tolerance" if failed else "all within tolerance", file=out)
    return 1 if failed else 0
