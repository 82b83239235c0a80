"""JAX kernels: ``jax.nn`` and ``jax.numpy`` with float32 accumulation.

Kernels marked ``pure`` run under ``jax.jit`` (one XLA computation per shape instead of one
dispatch per primitive in eager mode).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from portable_llm.core.arrays import exact_divide
from portable_llm.core.dispatch import native

_F64 = jnp.dtype(jnp.float64)


def _compute(dtype: Any) -> Any:
    return jnp.float64 if dtype == _F64 else jnp.float32


@native("jax", "softmax", kernel="jax.nn.softmax", pure=True)
def softmax(xp: Any, x: Any, *, axis: int) -> Any:
    return jax.nn.softmax(x.astype(_compute(x.dtype)), axis=axis).astype(x.dtype)


@native("jax", "silu", kernel="jax.nn.silu", pure=True)
def silu(xp: Any, x: Any) -> Any:
    return jax.nn.silu(x.astype(_compute(x.dtype))).astype(x.dtype)


@native("jax", "gelu", kernel="jax.nn.gelu(approximate=False)", pure=True)
def gelu(xp: Any, x: Any) -> Any:
    return jax.nn.gelu(x.astype(_compute(x.dtype)), approximate=False).astype(x.dtype)


@native("jax", "gelu_tanh", kernel="jax.nn.gelu(approximate=True)", pure=True)
def gelu_tanh(xp: Any, x: Any) -> Any:
    return jax.nn.gelu(x.astype(_compute(x.dtype)), approximate=True).astype(x.dtype)


@native("jax", "relu", kernel="jax.nn.relu", pure=True)
def relu(xp: Any, x: Any) -> Any:
    return jax.nn.relu(x)


@native("jax", "linear", kernel="jnp.matmul(preferred_element_type=float32)", pure=True)
def linear(xp: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    acc = _compute(x.dtype)
    y = jnp.matmul(x, weight.T, preferred_element_type=acc)
    if bias is not None:
        y = y + bias.astype(acc)
    return y.astype(x.dtype)


# -- attention ---------------------------------------------------------------------------------


def _platform(x: Any) -> str:
    try:
        return str(next(iter(x.devices())).platform)
    except jax.errors.ConcretizationTypeError:  # a tracer, inside the caller's jit
        return str(jax.default_backend())


def _sdpa_applies(q: Any, k: Any, v: Any, mask: Any, sinks: Any = None, *, opts: Any) -> bool:
    if opts.softcap is not None or sinks is not None:  # no score hook, no sink logit
        return False
    if v.shape[-1] != q.shape[-1]:  # it takes one head dim for q, k and v
        return False
    if q.dtype == _F64:  # it takes the softmax in float32: 1.8e-7 error, beyond float64's tolerance
        return False
    if q.dtype == jnp.float16 and _platform(q) == "cpu":
        # It asks for the F16_F16_F32 dot precision, which XLA's CPU backend rejects when the
        # kernel is compiled (jit): eager calls fall back, compiled ones fail.
        return False
    return mask is None or q.ndim <= 4 or mask.ndim <= 2


def _4d(x: Any) -> Any:
    return None if x is None else x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))


# In bfloat16 it rounds the probabilities to the input dtype before the product with v, as HF's
# eager attention does (within the tolerance).
@native(
    "jax",
    "scaled_dot_product_attention",
    kernel="jax.nn.dot_product_attention",
    applies=_sdpa_applies,
    pure=True,
)
def scaled_dot_product_attention(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    *,
    opts: Any,
) -> Any:
    # ``opts`` is an attn.sdpa_args.SdpaOptions; its methods hold the one visibility rule.
    shape = q.shape
    L, S, window = q.shape[-2], k.shape[-2], opts.window
    # (B.., H, L, D) -> (B, L, H, D): JAX's layout is BTNH.
    q, k, v = (a.reshape(-1, *a.shape[-3:]).transpose(0, 2, 1, 3) for a in (q, k, v))
    kw: dict[str, Any] = {}
    if opts.causal and mask is None and L == S:
        # is_causal and local_window_size are top-left aligned: bottom-right only when L == S.
        kw["is_causal"] = True
        if window is not None:
            kw["local_window_size"] = (window - 1, 0)
        attn = None
    else:
        attn = opts.combined_mask(jnp, mask, L, S, None)
    if attn is not None and attn.dtype != jnp.bool_:
        kw["bias"] = _4d(attn)
    elif attn is not None:
        kw["mask"] = _4d(attn)
    out = jax.nn.dot_product_attention(q, k, v, scale=opts.scale, **kw)
    out = out.transpose(0, 2, 1, 3).reshape(shape)  # (B.., H, L, D)
    if mask is not None:  # rows that see no key: JAX averages them (or NaN); ours are zeros
        out = opts.zero_unseen(jnp, out, attn)
    return out


# -- mixture of experts ------------------------------------------------------------------------


@native("jax", "top_k", kernel="jax.lax.top_k")
def top_k(xp: Any, x: Any, *, k: int) -> tuple[Any, Any]:
    # Documented tie order: the lower index first, as the portable stable descending argsort.
    return jax.lax.top_k(x, k)


# Contract the lhs's features with the rhs's last axis: the weights stay in the torch layout
# (X, out, in), the rows of lhs are grouped (ragged) along axis 0, one group per expert.
_RAGGED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def _ragged_preferred(x: Any, *_: Any, **__: Any) -> bool:
    # XLA:CPU lowers ragged_dot to a loop over every group at full size: on the CPU it was
    # measured 2.5x slower than the portable gather (81 vs 32 ms, 64 tokens, 8 experts, top-2)
    # and slower than impl="dense". auto takes it there only when tracing (jax.jit), where the
    # gather, which reads the per-expert counts back to the host, cannot run.
    return isinstance(x, jax.core.Tracer) or _platform(x) != "cpu"


# Static shapes (one compiled program per token count, none per routing outcome), no host
# sync, works under jax.jit. Accelerator backends have their own lowerings (not measured here).
# impl="portable" gathers with host-side counts instead.
@native("jax", "moe_experts", kernel="jax.lax.ragged_dot_general", prefer=_ragged_preferred)
def moe_experts(
    xp: Any, x: Any, weights: Any, ids: Any, gate: Any, up: Any, down: Any,
    b_gate: Any = None, b_up: Any = None, b_down: Any = None, *,
    act: Any, linear: Any, to_host: Any, glu: Any = None,
) -> Any:  # fmt: skip
    return _moe_experts(x, weights, ids, gate, up, down, b_gate, b_up, b_down, act=act, glu=glu)


@partial(jax.jit, static_argnames=("act", "glu"))  # one program per shape, also when eager
def _moe_experts(
    x: Any, weights: Any, ids: Any, gate: Any, up: Any, down: Any, b_gate: Any, b_up: Any,
    b_down: Any, *, act: Any, glu: Any,
) -> Any:  # fmt: skip
    # Static shapes throughout (group sizes stay on the device), so this traces under jax.jit.
    n, k = ids.shape
    acc = _compute(x.dtype)
    flat = ids.reshape(-1)  # (A,) token-major
    order = jnp.argsort(flat, stable=True)  # (A,) grouped by expert
    tokens = order // k
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)  # (X,)
    owner = flat[order]  # (A,) each assignment's expert

    def proj(a: Any, w: Any, b: Any) -> Any:  # (A, in) x (X, out, in) [+ b (X, out)] -> (A, out)
        y = jax.lax.ragged_dot_general(a, w, sizes, _RAGGED, preferred_element_type=acc)
        y = y.astype(x.dtype)
        return y if b is None else y + b.astype(x.dtype)[owner]  # gpt-oss: the expert's bias

    xs = x[tokens]  # (A, E)
    g, u = proj(xs, gate, b_gate), proj(xs, up, b_up)  # (A, I)
    # glu: ops.moe_experts.ClampedGlu (gpt-oss)
    h = act(jnp, g) * u if glu is None else glu(jnp, g, u)
    y = proj(h, down, b_down)  # (A, E)
    y = y.astype(weights.dtype) * weights.reshape(-1)[order][:, None]
    out = jnp.zeros((n, x.shape[-1]), weights.dtype).at[tokens].add(y)  # (N, E)
    return out.astype(x.dtype)


# -- quantized weights (portable_llm.ops.quant: MLX's affine format) ---------------------------
# One jitted program per shape, code width and dtype, also when called eagerly: the codes are
# unpacked, scaled and multiplied inside one XLA computation, which fuses the dequantize into the
# product's operand (measured eagerly on SmolLM2's float32 projections at one row, one thread:
# 1.1-3.7x the dense jitted matmul of the dequantized weight; the portable grouped sums that auto
# took for few eager rows ran 0.06-0.6x).


def _codes(packed: Any, bits: int) -> Any:
    """uint32 words ``(N, W)`` -> codes ``(N, W * 32 / bits)`` (uint32): each row one
    little-endian bit stream (``ops.quant``'s layout); shifts of uint32 are logical."""
    n, w = packed.shape
    mask = jnp.uint32((1 << bits) - 1)
    if 32 % bits == 0:
        shifts = jnp.arange(0, 32, bits, dtype=jnp.uint32)
        return ((packed[..., None] >> shifts) & mask).reshape(n, w * 32 // bits)
    blocks = packed.reshape(n, w // bits, bits)  # 32 codes per block of `bits` words
    parts = []
    for j in range(32):
        word, shift = divmod(bits * j, 32)
        code = blocks[..., word] >> jnp.uint32(shift)
        if shift + bits > 32:  # straddles: the high part is the low bits of the next word
            code = code | (blocks[..., word + 1] << jnp.uint32(32 - shift))
        parts.append(code & mask)
    return jnp.stack(parts, axis=-1).reshape(n, w * 32 // bits)  # (N, K)


def _qlinear_applies(x: Any, packed: Any, scales: Any, *_: Any, **__: Any) -> bool:
    # float64 keeps the portable path (XLA would fuse its multiply-add into one rounding there
    # too, but the reference arithmetic is float64 op by op)
    return x.dtype != _F64 and scales.dtype != _F64 and packed.ndim == 2


@native(
    "jax",
    "quantized_linear",
    kernel="jax.jit(dequantize + jnp.matmul)",
    applies=_qlinear_applies,
    pure=True,
)
def quantized_linear(
    xp: Any, x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int,
    group_size: int,
) -> Any:  # fmt: skip
    n, k = packed.shape[0], packed.shape[1] * 32 // bits
    acc = _compute(x.dtype)
    q = _codes(packed, bits).astype(acc).reshape(n, k // group_size, group_size)
    # The weight in float32, rounded to the scales' dtype after the multiply and after the add
    # as dequantize rounds it (XLA fuses a float32 multiply and add into one rounding: within
    # the tolerances), then to x's dtype (the one mixed rule); the product in float32 (XLA's
    # CPU dot of bfloat16 operands measured 2-7x slower than of the same values in float32).
    t = q * scales.astype(acc)[..., None]
    if scales.dtype != acc:
        t = t.astype(scales.dtype).astype(acc)
    w = (t + biases.astype(acc)[..., None]).reshape(n, k)  # (O, I)
    if scales.dtype != acc or x.dtype != acc:
        w = w.astype(scales.dtype).astype(x.dtype).astype(acc)
    y = jnp.matmul(_own_buffer(x.astype(acc)), w.T, preferred_element_type=acc)
    if bias is not None:
        y = y + bias.astype(acc)
    return y.astype(x.dtype)


def _own_buffer(x: Any) -> Any:
    """``x`` unchanged, computed into a buffer of its own before a product reads it.

    XLA's CPU fusion turns a product with one row (a decode step) into a loop fusion that also
    takes in the cheap elementwise producers of its vector operand (a norm's multiplies, the
    int8 mode's rounding and ``* d``) and evaluates them once per output element (the int8
    mode's rounding: 1536x576 one row 1.5-1.9 ms against 0.12-0.19 for x read from memory,
    1 thread, load 5-7). It never takes in an expensive producer (a division) whose consumer
    reuses its elements, so ``x`` ends in a true division by one (``exact_divide``: ``x / 1 ==
    x`` exactly, NaN stays NaN). ``lax.optimization_barrier`` does not do this on the CPU
    (removed before fusion: measured as slow as without it).
    """
    return exact_divide(jnp, x, jnp.ones_like(x))


def _conv_prefer(u: Any, weight: Any) -> bool:
    return bool(u.shape[1] > weight.shape[1])  # L > 1 tokens: one token takes the window


# short_conv: the depthwise convolution as a grouped lax.conv_general_dilated in float32 (float64
# for float64), channels last; the op adds the bias and activation and rounds once.
@native(
    "jax", "short_conv", kernel="jax.lax.conv_general_dilated(feature_group_count=C)",
    prefer=_conv_prefer, pure=True,
)  # fmt: skip
def short_conv(xp: Any, u: Any, weight: Any) -> Any:
    compute = _compute(u.dtype)
    rhs = jnp.transpose(weight.astype(compute))[:, None, :]  # (K, 1, C): width, in/group, out
    return jax.lax.conv_general_dilated(
        u.astype(compute), rhs, window_strides=(1,), padding="VALID",
        dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=weight.shape[0],
        precision=jax.lax.Precision.HIGHEST,
    )  # fmt: skip


# -- quantized codes times 8-bit activations (activations="int8") -------------------------------
# Two kernels of ops.quant_int8's definition:
# - quantized_linear_int8_integer: the integers in integer types: x's Q8_0 blocks and the
#   centred codes q - c as int8 (8-bit codes' -128 fits), one lax.dot_general batched over the
#   blocks with preferred_element_type=int32 (exact), then the portable path's float32
#   combination. Tested against the portable path, but not registered: XLA's CPU integer dots
#   are slower than its float32 ones (one 1536x576 row, 1 thread: int8 dot 307 us, float32
#   124 us; the whole kernel 7.4 ms against 138 us for the exact mode, load 18);
# - quantized_linear_int8 (registered): the blocks' values d * xq (the same codes) times the
#   dequantized weight in the exact kernel's float32 program: the int8 mode's product in
#   exact arithmetic, within float32's accumulation tolerance of the portable path (tested).


def _int8_applies(x: Any, packed: Any, scales: Any, *_: Any, **__: Any) -> bool:
    return x.dtype != _F64 and packed.ndim == 2  # float64 keeps the portable float64 path


def _q8_blocks(x: Any, a: int) -> tuple[Any, Any]:
    """x ``(.., K)``'s Q8_0 blocks: int8 codes ``(M, J, A)`` and float32 scales ``(M, J, 1)``,
    with true divisions (``exact_divide``) and half-to-even rounding, as the portable path."""
    xb = x.reshape(-1, x.shape[-1] // a, a).astype(jnp.float32)  # (M, J, A)
    amax = jnp.max(jnp.abs(xb), axis=-1, keepdims=True)  # (M, J, 1)
    d = exact_divide(jnp, amax, jnp.full_like(amax, 127.0))
    xq = jnp.round(exact_divide(jnp, xb, jnp.where(d > 0, d, 1.0))).astype(jnp.int8)
    return xq, d


def _q8_values(x: Any, *, block: int) -> Any:
    """The values ``d * xq`` ``(M, K)`` float32 of x's Q8_0 blocks (the product that reads them
    takes them as a buffer: ``_own_buffer``)."""
    xq, d = _q8_blocks(x, block)
    return (xq.astype(jnp.float32) * d).reshape(-1, x.shape[-1])  # (M, K)


# One program (``pure``: the backend jits it; a compiled decode step inlines it into its own).
@native(
    "jax",
    "quantized_linear_int8",
    kernel="jax.jit(Q8_0 blocks' values, then dequantize + jnp.matmul)",
    applies=_int8_applies,
    pure=True,
)
def quantized_linear_int8(
    xp: Any, x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int,
    group_size: int,
) -> Any:  # fmt: skip
    lead = tuple(x.shape[:-1])
    xv = _q8_values(x, block=min(32, group_size))  # ops.quant_int8.activation_block's rule
    f32 = [a.astype(jnp.float32) for a in (scales, biases)]
    b = None if bias is None else bias.astype(jnp.float32)
    y = quantized_linear(jnp, xv, packed, *f32, b, bits=bits, group_size=group_size)
    return y.astype(x.dtype).reshape(*lead, -1)  # (N.., O)


@partial(jax.jit, static_argnames=("bits", "group_size"))
def quantized_linear_int8_integer(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> Any:
    """The int8 mode with int8 operands and an int32 ``lax.dot_general`` (see above)."""
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    n, g = scales.shape
    a = min(32, group_size)
    j = k // a
    xq, d = _q8_blocks(x, a)  # (M, J, A), (M, J, 1)
    half = 1 << (bits - 1)
    q = (_codes(packed, bits).astype(jnp.int32) - half).astype(jnp.int8).reshape(n, j, a)
    # (M, J, A) . (N, J, A) over A, batched over J -> (J, M, N) int32
    dots = jax.lax.dot_general(
        xq, q, (((2,), (2,)), ((1,), (1,))), preferred_element_type=jnp.int32
    )
    sums = jnp.sum(xq, axis=-1, dtype=jnp.int32).astype(jnp.float32)  # (M, J)
    s = scales.astype(jnp.float32)
    b = biases.astype(jnp.float32) + float(half) * s  # (N, G): the centred codes' bias
    s, b = jnp.repeat(s, j // g, axis=1), jnp.repeat(b, j // g, axis=1)  # (N, J)
    dm = d[..., 0].T  # (J, M)
    y = jnp.sum(dots.astype(jnp.float32) * s.T[:, None, :] * dm[:, :, None], axis=0)  # (M, N)
    y = y + jnp.matmul(d[..., 0] * sums, b.T)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype).reshape(*lead, n)  # (N.., O)
