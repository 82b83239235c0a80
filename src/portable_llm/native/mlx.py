"""MLX kernels: ``mx.fast`` and fused MLX ops."""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import numpy as np

from portable_llm.core.dispatch import native

# mx.fast kernels and mx.erf compute float64 input at float32 precision (measured); auto keeps
# the portable path for float64, where MLX's float64 arithmetic is exact.
_BELOW_FLOAT64 = ("float16", "bfloat16", "float32")


# mx.fast.rms_norm computes float64 input in float32 (measured 3e-7 relative error); the
# portable path keeps float64 there (MLX's float64 sqrt and sums are exact).
@native("mlx", "rms_norm", kernel="mx.fast.rms_norm", auto_dtypes=_BELOW_FLOAT64)
def rms_norm(xp: Any, x: Any, weight: Any, *, eps: float) -> Any:
    # One fused kernel; it rounds the normalised value to x's dtype before the weight multiply,
    # as HF does (bit-identical to the portable path in bfloat16, measured).
    return mx.fast.rms_norm(x, weight, eps)


# mx.fast.layer_norm rounds the normalised value to x's dtype before the affine map (two
# roundings in float16/bfloat16: measured to differ from torch.nn.LayerNorm's single rounding in
# ~27% of the elements of a (4, 7, 128) input)
# and computes float64 input in float32: auto takes it for float32 only.
@native("mlx", "layer_norm", kernel="mx.fast.layer_norm", auto_dtypes=("float32",))
def layer_norm(xp: Any, x: Any, weight: Any = None, bias: Any = None, *, eps: float) -> Any:
    return mx.fast.layer_norm(x, weight, bias, eps)


@native("mlx", "softmax", kernel="mx.softmax(precise=True)")
def softmax(xp: Any, x: Any, *, axis: int) -> Any:
    return mx.softmax(x, axis=axis, precise=True)


@native("mlx", "gelu", kernel="mx.erf", auto_dtypes=_BELOW_FLOAT64)
def gelu(xp: Any, x: Any) -> Any:
    xc = x.astype(mx.float64 if x.dtype == mx.float64 else mx.float32)
    return (0.5 * xc * (1.0 + mx.erf(xc * 0.7071067811865476))).astype(x.dtype)


@native("mlx", "linear", kernel="mx.addmm")
def linear(xp: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    if bias is None:
        return mx.matmul(x, weight.T)
    return mx.addmm(bias, x, weight.T)


# -- attention ---------------------------------------------------------------------------------


_HALF = (mx.float16, mx.bfloat16)


def _probe_sinks() -> bool:
    """Whether ``mx.fast.scaled_dot_product_attention`` takes ``sinks=`` (MLX >= 0.29)."""
    t = mx.zeros((1, 1, 1, 1))
    try:
        mx.fast.scaled_dot_product_attention(t, t, t, scale=1.0, sinks=mx.zeros((1,)))
    except TypeError:
        return False
    return True


_HAS_SINKS = _probe_sinks()


def _sdpa_applies(q: Any, k: Any, v: Any, mask: Any, sinks: Any = None, *, opts: Any) -> bool:
    if opts.softcap is not None:  # no score hook in the fused kernel
        return False
    if sinks is not None and not _HAS_SINKS:
        return False
    if q.dtype in _HALF and mx.default_device() == mx.cpu:
        # On the CPU it computes the scores in q's dtype (as HF's eager attention does): at
        # D = 64 with scores of a few units, measured 4.7e-2 max error in bfloat16 and 6.8e-3 in
        # float16, beyond the tolerances. The portable path keeps the scores in float32.
        return False
    if mask is None:
        return True
    if mask.dtype != mx.bool_ and mask.dtype != q.dtype:
        return False  # MLX wants an additive mask in q's dtype; rounding it would change it
    return q.ndim <= 4 or mask.ndim <= 2  # a batch-shaped mask cannot follow flattened batches


# float64 runs at float32 precision (measured 1.2e-7): auto keeps the portable path there.
@native(
    "mlx",
    "scaled_dot_product_attention",
    kernel="mx.fast.scaled_dot_product_attention",
    applies=_sdpa_applies,
    auto_dtypes=_BELOW_FLOAT64,
)
def scaled_dot_product_attention(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    sinks: Any = None,
    *,
    opts: Any,
) -> Any:
    shape = (*q.shape[:-1], v.shape[-1])  # (B.., H, L, D_v)
    if q.ndim != 4:  # the kernel takes exactly (B, H, L, D)
        q, k, v = (a.reshape(-1, *a.shape[-3:]) for a in (q, k, v))
    # ``opts`` is an attn.sdpa_args.SdpaOptions; its methods hold the one visibility rule.
    L, S = q.shape[-2], k.shape[-2]
    if opts.causal and opts.window is None and mask is None:
        attn: Any = "causal"  # MLX's "causal" is bottom-right aligned, as ours
    else:
        attn = opts.combined_mask(xp, mask, L, S, None)
    # The sinks (H,) join each row's softmax in the kernel, as sdpa_direct's sink_step does.
    extra = {} if sinks is None else {"sinks": sinks}
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=opts.scale, mask=attn, **extra)
    if mask is not None:  # rows that see no key: MLX gives NaN or a mean; ours are zeros
        out = opts.zero_unseen(xp, out, attn)
    return out.reshape(shape)


# -- mixture of experts ------------------------------------------------------------------------


def _gather_mm_applies(x: Any, *_: Any, **__: Any) -> bool:
    # MLX 0.32's CPU gather_mm takes float32 only; the GPU takes the half dtypes too.
    return bool(x.dtype == mx.float32 or mx.default_device() == mx.gpu)


@native("mlx", "moe_experts", kernel="mx.gather_mm", applies=_gather_mm_applies)
def moe_experts(
    xp: Any, x: Any, weights: Any, ids: Any, gate: Any, up: Any, down: Any,
    b_gate: Any = None, b_up: Any = None, b_down: Any = None, *,
    act: Any, linear: Any, to_host: Any, glu: Any = None,
) -> Any:  # fmt: skip
    def matmul(a: Any, j: int, idx: Any) -> Any:  # (A, 1, in) x (X, out, in) -> (A, 1, out)
        w = (gate, up, down)[j]
        return mx.gather_mm(a, w.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True)

    return _switch(xp, x, weights, ids, matmul, (b_gate, b_up, b_down), act, glu)


def _switch(
    xp: Any, x: Any, weights: Any, ids: Any, matmul: Any, biases: tuple[Any, Any, Any],
    act: Any, glu: Any,
) -> Any:  # fmt: skip
    """mlx-lm's SwitchGLU: each (token, slot) row multiplies its expert's matrix, gathered
    (``matmul(a, j, idx)``: projection ``j`` of gate, up, down of the experts ``idx``)."""
    n, k = ids.shape
    flat = ids.reshape(-1)  # (A,)
    order = mx.argsort(flat)  # grouped by expert: contiguous reads of each expert's weights
    xs = x[order // k][:, None, :]  # (A, 1, E)
    idx = flat[order]

    def proj(a: Any, j: int) -> Any:  # (A, 1, in) -> (A, 1, out)
        y, b = matmul(a, j, idx), biases[j]
        return y if b is None else y + b[idx][:, None, :]  # gpt-oss: the expert's bias

    g, u = proj(xs, 0), proj(xs, 1)  # (A, 1, I)
    h = act(xp, g) * u if glu is None else glu(xp, g, u)  # glu: moe_experts.ClampedGlu
    y = proj(h, 2)[:, 0, :]  # (A, E)
    y = y.astype(weights.dtype) * weights.reshape(-1)[order][:, None]
    y = y[mx.argsort(order)].reshape(n, k, x.shape[-1])  # token-major
    return y.sum(axis=1).astype(x.dtype)


# -- rope --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _periods(table: bytes) -> Any:
    """``freqs`` for mx.fast.rope, which uses ``1 / freqs``: periods whose float32 reciprocal
    is exactly the table's ``theta_i`` (a neighbour of ``1 / theta_i`` where that one is not)."""
    inv = np.frombuffer(table, dtype=np.float32)
    periods = np.float32(1) / inv
    for _ in range(4):
        back = np.float32(1) / periods
        if np.array_equal(back, inv):
            break
        periods = np.where(back > inv, np.nextafter(periods, np.float32(np.inf)), periods)
        periods = np.where(back < inv, np.nextafter(periods, np.float32(0)), periods)
    return mx.array(periods)


def _rope_applies(
    x: Any, offsets: Any, inv_freq: Any, *, offset: int, dims: int, traditional: bool,
    attention: float,
) -> bool:  # fmt: skip
    # The kernel has no factor on cos/sin (yarn's attention factor); scaling x instead, as
    # mlx-lm does, would round differently.
    return attention == 1.0


# Its angles are float32, so auto keeps the portable path (float64 angles) for float64 input.
@native("mlx", "rope", kernel="mx.fast.rope", applies=_rope_applies, auto_dtypes=_BELOW_FLOAT64)
def rope(
    xp: Any, x: Any, offsets: Any, inv_freq: Any, *, offset: int, dims: int, traditional: bool,
    attention: float,
) -> Any:  # fmt: skip
    # The kernel takes the same float32 table (freqs), offsets of shape () or (B,), and rounds
    # cos/sin to x's dtype before rotating in x's dtype, as the portable path.
    y = x if x.ndim >= 3 else x.reshape(1, *x.shape)  # it wants (B, .., L, D)
    out = mx.fast.rope(
        y,
        dims,
        traditional=traditional,
        base=None,
        scale=1.0,
        offset=offset if offsets is None else offsets,
        freqs=_periods(np.array(inv_freq).astype(np.float32).tobytes()),
    )
    return out.reshape(x.shape)


# -- quantized weights (MLX's own affine format: portable_llm.ops.quant) -----------------------
# mx.quantize/mx.dequantize are bit-identical to the portable path (tested); they take no
# float64, where the portable path runs.


#: The group sizes of MLX's quantized kernels (the format's groups of 16, llama.cpp's Q6_K, run
#: the portable paths).
_GROUPS = (32, 64, 128)


def _not_float64(w: Any, *_: Any, **__: Any) -> bool:
    return w.dtype != mx.float64


def _quantize_applies(w: Any, *, bits: int, group_size: int) -> bool:
    return _not_float64(w) and group_size in _GROUPS  # a group of 16: portable


@native("mlx", "quantize", kernel="mx.quantize", applies=_quantize_applies)
def quantize(xp: Any, w: Any, *, bits: int, group_size: int) -> Any:
    return tuple(mx.quantize(w, group_size=group_size, bits=bits))


def _dequantize_applies(packed: Any, scales: Any, *_: Any, group_size: int, **__: Any) -> bool:
    return scales.dtype != mx.float64 and group_size in _GROUPS


@native("mlx", "dequantize", kernel="mx.dequantize", applies=_dequantize_applies)
def dequantize(
    xp: Any, packed: Any, scales: Any, biases: Any, *, bits: int, group_size: int
) -> Any:
    return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)


def _qmm_applies(x: Any, packed: Any, scales: Any, *_: Any, group_size: int, **__: Any) -> bool:
    return scales.dtype == x.dtype and x.dtype != mx.float64 and group_size in _GROUPS


def _on_cpu() -> bool:
    return bool(mx.default_device() == mx.cpu)


def _qmm_prefer(x: Any, *_: Any, **__: Any) -> bool:
    # On the CPU, quantized_matmul accumulates float16/bfloat16 in their own precision (measured
    # at K = 512: 4.6e-2 of the largest output in bfloat16, 5.5e-3 in float16, 15-20x the float32
    # accumulation of the portable path and beyond the tolerances); float32 matches it (7e-7).
    # There the kernel below runs half dtypes at float32 instead, whose weight s * q + b is not
    # rounded to the half dtype as dequantize's is (beyond the tolerance where a row's terms
    # cancel), so auto keeps the portable path for them on the CPU.
    return x.dtype == mx.float32 or not _on_cpu()


@native(
    "mlx",
    "quantized_linear",
    kernel="mx.quantized_matmul",
    applies=_qmm_applies,
    prefer=_qmm_prefer,
)
def quantized_linear(
    xp: Any, x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int,
    group_size: int,
) -> Any:  # fmt: skip
    if x.dtype != mx.float32 and _on_cpu():
        # float32 arithmetic for half dtypes (x, scales, biases upcast; measured at SmolLM2's
        # decode shapes 0.75-1.3x the dense bfloat16 matmul, against 0.04-0.16x for the kernel
        # at bfloat16, whose half-precision sums are beyond the tolerances)
        f32 = mx.float32
        y = mx.quantized_matmul(
            x.astype(f32), packed, scales.astype(f32), biases.astype(f32), transpose=True,
            group_size=group_size, bits=bits,
        ).astype(x.dtype)  # fmt: skip
    else:
        y = mx.quantized_matmul(
            x, packed, scales, biases, transpose=True, group_size=group_size, bits=bits
        )
    return y if bias is None else y + bias


# -- quantized codes times 8-bit activations (activations="int8") -------------------------------
# MLX has no integer matmul (and mx.quantized_matmul multiplies the codes by float activations:
# the exact mode). The nearest kernel that keeps the int8 mode's meaning: x rounded to its
# Q8_0 blocks (the same codes and scales as the portable path: true divisions, half to even),
# their values d * xq multiplied by the codes with mx.quantized_matmul in float32 (x, scales and
# biases upcast: the mode sums in float32). Equal to the mode's integer products in exact
# arithmetic; in float32 within its accumulation tolerance of the portable path (tested).


def _int8_applies(x: Any, packed: Any, scales: Any, *_: Any, group_size: int, **__: Any) -> bool:
    return x.dtype != mx.float64 and packed.ndim == 2 and group_size in _GROUPS


@native(
    "mlx",
    "quantized_linear_int8",
    kernel="Q8_0 blocks' values + mx.quantized_matmul (float32)",
    applies=_int8_applies,
)
def quantized_linear_int8(
    xp: Any, x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int,
    group_size: int,
) -> Any:  # fmt: skip
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    a = min(32, group_size)  # ops.quant_int8.activation_block's rule (native sits below ops)
    xb = x.reshape(-1, k // a, a).astype(mx.float32)  # (M, J, A)
    amax = mx.max(mx.abs(xb), axis=-1, keepdims=True)  # (M, J, 1)
    d = amax / 127.0
    xq = mx.round(xb / mx.where(d > 0, d, 1.0))  # half to even; |xb / d| <= 127
    xv = (xq * d).reshape(-1, k)  # (M, K): the blocks' values
    f32 = mx.float32
    y = mx.quantized_matmul(
        xv, packed, scales.astype(f32), biases.astype(f32), transpose=True,
        group_size=group_size, bits=bits,
    )  # fmt: skip
    if bias is not None:
        y = y + bias.astype(f32)
    return y.astype(x.dtype).reshape(*lead, -1)  # (N.., O)


def _probe_mxfp4() -> bool:
    """Whether the installed MLX's quantized_matmul takes ``mode="mxfp4"`` (MLX >= 0.29)."""
    try:
        w = mx.zeros((1, 4), dtype=mx.uint32)
        mx.quantized_matmul(mx.zeros((1, 32)), w, mx.zeros((1, 1), dtype=mx.uint8),
                            transpose=True, group_size=32, bits=4, mode="mxfp4")  # fmt: skip
    except (TypeError, ValueError):
        return False
    return True


_HAS_MXFP4 = _probe_mxfp4()


# MXFP4's weights (FP4 E2M1 times a power of two) are exact in every float dtype's range, so the
# float32 product of a half x below equals the portable path's, which dequantizes to x's dtype.
# float64 x would be multiplied in float32: auto keeps the portable path there.
@native(
    "mlx",
    "quantized_linear_mxfp4",
    kernel='mx.quantized_matmul(mode="mxfp4")',
    applies=lambda *_, **__: _HAS_MXFP4,
    auto_dtypes=_BELOW_FLOAT64,
)
def quantized_linear_mxfp4(xp: Any, x: Any, packed: Any, scales: Any, bias: Any) -> Any:
    # On the CPU the kernel would sum half dtypes in their own precision (as the affine mode's,
    # above): half x is multiplied in float32 and rounded once.
    xf = x if x.dtype == mx.float32 or not _on_cpu() else x.astype(mx.float32)
    y = mx.quantized_matmul(xf, packed, scales, transpose=True, group_size=32, bits=4,
                            mode="mxfp4")  # fmt: skip
    y = y if bias is None else y + bias.astype(y.dtype)
    return y.astype(x.dtype)


def _gather_qmm_applies(x: Any, *_: Any, **__: Any) -> bool:
    # as gather_mm: float32 on the CPU (whose kernels keep half sums in the half dtype)
    return _HAS_MXFP4 and bool(x.dtype == mx.float32 or mx.default_device() == mx.gpu)


# gpt-oss's MXFP4 experts kept quantized: each (token, slot) row multiplies its expert's codes
# (MXFP4Weight's words and exponents are MLX's mode="mxfp4" arrays as they are).
@native("mlx", "moe_experts_mxfp4", kernel='mx.gather_qmm(mode="mxfp4")',
        applies=_gather_qmm_applies)  # fmt: skip
def moe_experts_mxfp4(
    xp: Any, x: Any, weights: Any, ids: Any, gate_packed: Any, gate_scales: Any, up_packed: Any,
    up_scales: Any, down_packed: Any, down_scales: Any, b_gate: Any = None, b_up: Any = None,
    b_down: Any = None, *, act: Any, linear: Any, to_host: Any, glu: Any = None,
) -> Any:  # fmt: skip
    q = ((gate_packed, gate_scales), (up_packed, up_scales), (down_packed, down_scales))

    def matmul(a: Any, j: int, idx: Any) -> Any:  # (A, 1, in) x codes (X, out, in) -> (A, 1, out)
        return mx.gather_qmm(a, *q[j], None, rhs_indices=idx, transpose=True, group_size=32,
                             bits=4, mode="mxfp4", sorted_indices=True)  # fmt: skip

    return _switch(xp, x, weights, ids, matmul, (b_gate, b_up, b_down), act, glu)


# -- paged attention (portable_llm.attn.paged) -------------------------------------------------
# The pages a batch uses are gathered into contiguous keys (one take), then attended by the
# fused SDPA kernel above with the per-row causal mask of the options record
# (opts: attn.paged_args.PagedOptions).


def _paged_applies(
    q: Any, k_pages: Any, v_pages: Any, tables: Any, lens: Any, page_map: Any, sinks: Any = None,
    *, opts: Any,
) -> bool:  # fmt: skip
    return _sdpa_applies(q, k_pages, v_pages, None, sinks, opts=opts.sdpa)


def _paged_prefer(*args: Any, opts: Any) -> bool:
    # Where the arguments came with a page map (decode over a full pool), the portable
    # pool-wide path reads each key once, where a gather reads it three times: faster here
    # too (measured at S = 2048).
    return args[5] is None


@native(
    "mlx",
    "paged_attention",
    kernel="mx.take + mx.fast.scaled_dot_product_attention",
    applies=_paged_applies,
    prefer=_paged_prefer,
    auto_dtypes=_BELOW_FLOAT64,
)
def paged_attention(
    xp: Any,
    q: Any,
    k_pages: Any,
    v_pages: Any,
    tables: Any,
    lens: Any,
    page_map: Any,
    sinks: Any = None,
    *,
    opts: Any,
) -> Any:
    k, v = opts.gather(xp, k_pages, tables), opts.gather(xp, v_pages, tables)  # (B, H_kv, S, D)
    mask = opts.mask(xp, lens, q.shape[2], k.shape[2], 0, None)  # (B, 1, L, S)
    return scaled_dot_product_attention(xp, q, k, v, mask, sinks, opts=opts.sdpa)


def _conv_prefer(u: Any, weight: Any) -> bool:
    return bool(u.shape[1] > weight.shape[1])  # L > 1 tokens: one token takes the window


# short_conv: the depthwise convolution as a grouped mx.conv1d (channels last, mlx-lm's
# ShortConv) in float32 (float64 for float64); the op adds the bias and activation.
@native("mlx", "short_conv", kernel="mx.conv1d(groups=C)", prefer=_conv_prefer)
def short_conv(xp: Any, u: Any, weight: Any) -> Any:
    compute = mx.float64 if u.dtype == mx.float64 else mx.float32
    w = weight.astype(compute)[:, :, None]  # (C, K, 1): out, width, in/group
    return mx.conv1d(u.astype(compute), w, groups=weight.shape[0])
