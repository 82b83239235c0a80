"""PyTorch kernels: ``torch.nn.functional``."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from portable_llm.core.dispatch import native
from portable_llm.native import numba_cpu

_HALF = (torch.float16, torch.bfloat16)


# For float16/bfloat16, F.rms_norm multiplies by the weight in float32 and rounds once, where
# HF rounds the normalised value first: one ulp apart in ~27% of elements. auto keeps HF's exact
# bits there (portable path); float32/float64 have no intermediate rounding to disagree on.
@native(
    "torch", "rms_norm", kernel="torch.nn.functional.rms_norm", auto_dtypes=("float32", "float64")
)
def rms_norm(xp: Any, x: Any, weight: Any, *, eps: float) -> Any:
    # torch.rms_norm is the op F.rms_norm wraps (same kernel, one Python frame less).
    return torch.rms_norm(x, x.shape[-1:], weight, eps)  # weight: (D,) or None


# Gemma's order (scale 1 + w applied in float32, one rounding) is F.rms_norm's on float32 input.
@native("torch", "rms_norm_offset", kernel="torch.nn.functional.rms_norm(float32)")
def rms_norm_offset(xp: Any, x: Any, weight: Any, *, eps: float, offset: float) -> Any:
    if x.dtype in _HALF:
        scale = weight.float() + offset
        return torch.rms_norm(x.float(), x.shape[-1:], scale, eps).to(x.dtype)
    return torch.rms_norm(x, x.shape[-1:], weight + offset, eps)


# F.layer_norm computes float16/bfloat16 input in float32 (mean, variance and the affine map)
# and rounds once, as the portable path does.
@native("torch", "layer_norm", kernel="torch.nn.functional.layer_norm")
def layer_norm(xp: Any, x: Any, weight: Any = None, bias: Any = None, *, eps: float) -> Any:
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


@native("torch", "softmax", kernel="torch.softmax")
def softmax(xp: Any, x: Any, *, axis: int) -> Any:
    if x.dtype in _HALF:
        return torch.softmax(x, axis, dtype=torch.float32).to(x.dtype)
    return torch.softmax(x, axis)


@native("torch", "silu", kernel="torch.nn.functional.silu")
def silu(xp: Any, x: Any) -> Any:
    return F.silu(x)


# F.gelu (the erf form) of +inf is NaN for float32 and bfloat16 on the CPU (torch 2.x): the
# kernel computes inf * (1 + erf(inf)) through a path that yields NaN. GELU(+inf) is +inf, as
# the portable path and every other backend give: put it back.
@native("torch", "gelu", kernel="torch.nn.functional.gelu")
def gelu(xp: Any, x: Any) -> Any:
    return torch.where(x == math.inf, x, F.gelu(x))


@native("torch", "gelu_tanh", kernel="torch.nn.functional.gelu(approximate='tanh')")
def gelu_tanh(xp: Any, x: Any) -> Any:
    return F.gelu(x, approximate="tanh")


# gpt-oss's clamped SwiGLU in five torch ops (the portable path's twelve: full-size limits,
# where-based logistic), in float32 (float64 for float64) and rounded once, as the portable path.
@native("torch", "clamped_swiglu", kernel="torch.clamp + torch.sigmoid")
def clamped_swiglu(xp: Any, gate: Any, up: Any, *, limit: float, alpha: float) -> Any:
    ct = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g = gate.to(ct).clamp(max=limit)  # the gate: clamped above only
    u = up.to(ct).clamp(min=-limit, max=limit)
    return ((u + 1.0) * (g * torch.sigmoid(g * alpha))).to(gate.dtype)


@native("torch", "relu", kernel="torch.relu")
def relu(xp: Any, x: Any) -> Any:
    return torch.relu(x)


@native("torch", "linear", kernel="torch.nn.functional.linear")
def linear(xp: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    return F.linear(x, weight, bias)


# A model's own products (``model_linear``, the kernel its kernel sets bind: decoder/prepared.py
# and ops/checked_kernels.py; the public ``linear`` stays F.linear). float32, one row of x (a
# decode step), on the CPU, torch at one thread: NumPy's BLAS (OpenBLAS in NumPy's wheels)
# streams the weight faster than F.linear's GEMV (1 thread, SmolLM2's 1536x576: 103 against
# 191 us; its 49152x576 head: 3.8 against 6.9 ms; measured again at bd4d722: 10-35% per
# projection shape, benchmarks/README.md), so a float32 decode step runs 1.5-1.65x faster
# (SmolLM2, 26.6 -> 40-44 tok/s; 50-55 with NumPy's BLAS at 2 threads beside torch's one).
# Only at one torch thread: with two, torch's OpenMP workers and BLAS's threads contend for the
# cores between ops (3.7 tok/s measured, idle 2-core VM), and F.linear (whose GEMV does not use
# the second core anyway: 25.7 against 25.6 ms for the 30 layers) runs. From two rows on
# F.linear is as fast or faster (measured 2 to 64 rows). Not where autograd, torch.compile or a
# torch.func transform sees the tensors: NumPy is outside their graphs.
def numpy_gemv_applies(x: Any, weight: Any, bias: Any) -> bool:
    """Whether ``model_linear`` runs NumPy's product for these arguments (checked per call)."""
    return (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.shape[:-1].numel() == 1  # one row
        and torch.get_num_threads() == 1
        and weight.ndim == 2
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.layout == torch.strided
        and weight.layout == torch.strided
        and not (
            torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or getattr(bias, "requires_grad", False))
        )
        and not traced()
        and not _functorch_wrapped(x)
        and not _functorch_wrapped(weight)
    )


def traced() -> bool:
    """Whether a compiler records torch's ops now: dynamo (``torch.compile``), or ``make_fx``'s
    proxy mode (the compiled decode step, :mod:`portable_llm.native.torch_compile`). NumPy is
    outside their graphs: a kernel that computes through NumPy would be baked in as a constant."""
    return torch.compiler.is_compiling() or get_proxy_mode() is not None


_functorch_wrapped = getattr(
    getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", lambda t: False
)


@native(
    "torch",
    "model_linear",
    kernel="numpy.matmul (one float32 row, one thread) | torch.nn.functional.linear",
)
def model_linear(xp: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    if numpy_gemv_applies(x, weight, bias):
        y = torch.from_numpy(x.detach().numpy().reshape(1, -1) @ weight.detach().numpy().T)
        y = y.reshape(*x.shape[:-1], weight.shape[0])  # (N.., O)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


# A weight bound once (the prepared model's projections) can be packed once into oneDNN's
# layout, as inductor's freezing packs CPU weights. In bfloat16, F.linear runs oneDNN on the
# plain weight and the packed product gives the same bits (tested: decode and prefill rows);
# it skips the per-call reorder (SmolLM2-135M bfloat16 decode 1.5x, 2-core CPU, 1 thread). In
# float32 F.linear's GEMV and the packed GEMM round differently: left as it is.
#
# oneDNN's half-precision packing needs CPU features that F.linear does not: bfloat16 needs
# AVX-512 BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only x86 CPU raises "mkldnn_reorder_linear_weight:
# bf16 path needs the cpu support ..."), float16 AVX512-FP16 or AVX-NE-CONVERT (most CPUs lack
# it); float32 packs everywhere. Where the CPU lacks them the packing never applies (auto binds
# the plain weight, impl="native" refuses with a clear error). The checks are torch's own (the
# ones its reorder consults, which honour ``ONEDNN_MAX_CPU_ISA``), asked once per process.
@functools.cache
def packing_supported(dtype: Any) -> bool:
    """Whether this process's CPU runs oneDNN's weight packing for ``dtype`` (checked once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    query = {
        torch.bfloat16: "_is_mkldnn_bf16_supported",
        torch.float16: "_is_mkldnn_fp16_supported",
    }
    name = query.get(dtype)
    probe = getattr(torch.ops.mkldnn, f"{name}_supported", None) if name else None
    if probe is not None:
        return bool(probe())
    try:  # float32, or a torch without the query: pack a tiny weight and see
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def _pack_applies(w: Any) -> bool:
    cpu = w.device.type == "cpu" and w.ndim == 2 and not w.requires_grad
    return cpu and packing_supported(w.dtype)


@native(
    "torch",
    "pack_linear",
    kernel="torch.ops.mkldnn._reorder_linear_weight",
    applies=_pack_applies,
    auto_dtypes=("bfloat16",),
)
def pack_linear(xp: Any, w: Any) -> Any:
    return torch.ops.mkldnn._reorder_linear_weight(w, 1)  # (O, I), an mkldnn tensor


@native("torch", "packed_linear", kernel="torch.ops.mkldnn._linear_pointwise")
def packed_linear(xp: Any, x: Any, w: Any, bias: Any) -> Any:
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


# -- attention ---------------------------------------------------------------------------------


def _probe_enable_gqa() -> bool:
    t = torch.zeros(1, 1, 1)
    try:
        F.scaled_dot_product_attention(t, t, t, enable_gqa=False)
    except TypeError:  # torch < 2.5
        return False
    return True


_HAS_GQA = _probe_enable_gqa()


def _sdpa_applies(q: Any, k: Any, v: Any, mask: Any, sinks: Any = None, *, opts: Any) -> bool:
    if opts.softcap is not None or sinks is not None:  # no score hook, no sink logit
        return False
    if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
        return False  # torch would round an additive mask to q's dtype
    return _HAS_GQA or q.shape[-3] == k.shape[-3]


def _sdpa_prefer(q: Any, k: Any, v: Any, mask: Any, sinks: Any = None, *, opts: Any) -> bool:
    """Not for one query row inside a compiled step's trace: there the portable path's matmuls
    and softmax compile with the rest (measured: torch's flash kernel for CPU took 0.4 ms a
    layer at load 10 in SmolLM2's compiled step, a fifth of the step)."""
    return not (q.shape[-2] == 1 and traced())


@native(
    "torch",
    "scaled_dot_product_attention",
    kernel="torch.nn.functional.scaled_dot_product_attention",
    applies=_sdpa_applies,
    prefer=_sdpa_prefer,
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
    L, S, scale = q.shape[-2], k.shape[-2], opts.scale
    # enable_gqa only when needed: torch < 2.5 has no such argument (MHA still runs there).
    gqa: dict[str, Any] = {"enable_gqa": True} if q.shape[-3] != k.shape[-3] else {}
    if mask is None and opts.window is None and (not opts.causal or L == 1 or L == S):
        if opts.causal and L == S > 1:  # is_causal is top-left aligned: bottom-right if L == S
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **gqa)
            return _keep_nan(q, k, out)
        if L == 1 and q.dtype in _HALF and q.device.type == "cpu":
            return _one_query(q, k, v, scale)
        # Every query sees every key (a decode step's one query, too). The (1, 1) mask keeps
        # the kernel's speed (measured) and NaN: without a mask, torch's CPU kernel returns
        # zeros for a NaN query.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_all(q), scale=scale, **gqa)
    attn = opts.combined_mask(xp, mask, L, S, q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn, scale=scale, **gqa)
    return out if mask is None else opts.zero_unseen(xp, out, attn)


def _one_query(q: Any, k: Any, v: Any, scale: float) -> Any:
    """One query per head seeing every key (a decode step), for float16/bfloat16 on the CPU.

    Two matmuls and a softmax in float32, as the portable path computes them: torch's CPU
    kernel takes 2-7x longer for one half-precision query (SmolLM2's shapes, H=9, H_kv=3,
    D=64, S=150..1000: 445 vs 171 us, 2.5 ms vs 0.23 ms, 1 thread). NaN propagates.
    """
    *lead, h, _, d = q.shape
    h_kv = k.shape[-3]
    qg = q.reshape(*lead, h_kv, h // h_kv, d).float() * scale  # (B.., H_kv, G, D)
    s = torch.matmul(qg, k.float().transpose(-1, -2))  # (B.., H_kv, G, S)
    out = torch.matmul(torch.softmax(s, -1), v.float())  # (B.., H_kv, G, D_v)
    return out.reshape(*q.shape[:-1], v.shape[-1]).to(q.dtype)  # (B.., H, 1, D_v)


def _all(q: Any) -> Any:
    return torch.ones((1, 1), dtype=torch.bool, device=q.device)


def _keep_nan(q: Any, k: Any, out: Any) -> Any:
    """NaN in the causal rows whose every visible score is NaN, as the portable path gives.

    With ``is_causal=True`` torch's CPU kernel returns zeros there: the rows of a query holding
    a NaN, and row ``i`` when keys ``0 .. i`` all hold one. A row sum finds them (NaN in, NaN
    out): one read of q and of k, within the timing noise of the attention at L = S = 512
    (measured); the output is copied only when such a row exists (on the CPU, where asking
    costs no device sync).
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # no half overflow
    q_nan = torch.isnan(q.sum(-1, dtype=acc))  # (B.., H, L)
    k_nan = torch.isnan(k.sum(-1, dtype=acc)).to(torch.uint8)  # (B.., H_kv, S = L)
    prefix = torch.cummin(k_nan, dim=-1).values.bool()  # keys 0 .. i all NaN
    bad = q_nan | prefix.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-2)  # (B.., H, L)
    if out.device.type == "cpu" and not bool(bad.any()):
        return out
    return torch.where(bad[..., None], torch.full_like(out, math.nan), out)


# -- quantized weights (portable_llm.ops.quant): torch's int4 and int8 CPU kernels, bytes -------
# 4-bit: MLX's affine format, w = s * q + b, is torch's int4 format w = s * (q - 8) + z with
# z = b + 8 * s; the weight is repacked once (_convert_weight_to_int4pack_for_cpu) and cached
# with the tensor it came from. 5- to 8-bit codes go through the same kernel as two nibble
# planes, q = lo + 16 * hi, side by side along K (_int4_pack). float32 with 4 or 8 bits: the
# codes read as bytes (_bytes_grouped), or _weight_int8pack_mm once per group (below).
import sys  # noqa: E402
import weakref  # noqa: E402

# The byte path's (G, M, N) partial sums stay below a quarter of the (N, K) weight it avoids
# while the rows M are at most group_size / 4 (the portable grouped path's rule, too).
_BYTE_ROWS = 4

# (kind, id(packed)) -> (weakref to packed, scales, biases, repacked arrays); an entry goes with
# its packed tensor (torch tensors compare elementwise: no WeakKeyDictionary).
_PACKS: dict[tuple[str, int], tuple[Any, Any, Any, tuple[Any, ...]]] = {}


def _repacked(
    kind: str,
    packed: Any,
    scales: Any,
    biases: Any,
    dtype: Any,
    build: Callable[[], tuple[Any, ...]],
) -> tuple[Any, ...]:
    """``build()``'s arrays for this weight, built once (again if scales, biases or the dtype
    of the last array change)."""
    key = (kind, id(packed))
    hit = _PACKS.get(key)
    same = hit is not None and hit[0]() is packed and hit[1] is scales and hit[2] is biases
    if same and hit is not None and hit[3][-1].dtype == dtype:
        return hit[3]
    arrays = build()
    if not same:
        weakref.finalize(packed, _PACKS.pop, key, None)
    _PACKS[key] = (weakref.ref(packed), scales, biases, arrays)
    return arrays


def _int4_applies(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> bool:
    # Other widths than 4 only in bfloat16, where the kernel is vectorized (AVX512/AVX2; float32
    # and float16 run its scalar loop on x86: 10-100x slower, measured).
    return (
        (bits == 4 or x.dtype == torch.bfloat16)
        and group_size in _INT4_GROUPS
        and packed.ndim == 2
        and packed.shape[0] % 16 == 0  # the int4 packing takes N in multiples of 16
        and x.device.type == "cpu"
        and sys.byteorder == "little"  # the codes are read as bytes (_codes)
        and scales.dtype == x.dtype
        and x.dtype != torch.float64
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    )


#: The group sizes _weight_int4pack_mm_for_cpu takes (it refuses 16).
_INT4_GROUPS = (32, 64, 128, 256)


def _codes(packed: Any, bits: int) -> Any:
    """``(N, W)`` uint32 words -> ``(N, W * 32 / bits)`` uint8 codes (ops.quant's layout: each
    row one little-endian bit stream, code ``k`` at bits ``bits*k ..``). Every 8 codes fill
    ``bits`` whole bytes: code ``j`` of them starts in byte ``bits*j // 8`` at bit
    ``bits*j % 8`` and takes the low bits of the next byte where it straddles (uint8 shifts,
    which drop the bits above 8: one byte a code, no wider temporaries)."""
    n = packed.shape[0]
    by = packed.view(torch.uint8).reshape(n, -1, bits)  # (N, K/8, bits)
    mask = (1 << bits) - 1
    parts = []
    for j in range(8):
        byte, off = divmod(bits * j, 8)
        c = by[..., byte] >> off
        if off + bits > 8:
            c = c | (by[..., byte + 1] << (8 - off))
        parts.append(c & mask if bits < 8 else c)
    return torch.stack(parts, dim=-1).reshape(n, -1)  # (N, K)


def _int4_pack(
    packed: Any, scales: Any, biases: Any, dtype: Any, bits: int
) -> tuple[Any, ...]:  # fmt: skip
    """The int4 kernel's weight and scales-and-zeros ``(K' / group, N, 2)`` in ``dtype``.

    The kernel computes ``w = s (c - 8) + z`` for stored codes ``c`` in 0..15. With
    ``h = 2**(bits - 1)``, the middle code: up to 4 bits, K' = K, ``c = q + 8 - h`` and
    ``z = b + h s``, the group's middle value (not ``b + 8 s``, which for 2 bits lies three
    ranges away: its rounding to bfloat16 showed beyond the tolerance). 5 to 8 bits: the codes
    split into nibble planes ``q = lo + 16 hi`` laid side by side, K' = 2K (x is repeated to
    match): low-plane groups ``c = lo`` with ``(s, b + h s)``, high-plane groups
    ``c = hi + 8 - h / 16`` with ``(16 s, 8 s)``; their sum is ``s q + b`` (16 s and 8 s exact).
    """

    def build() -> tuple[Any, Any]:
        codes = _codes(packed, bits).to(torch.int32)  # (N, K)
        s32, b32 = scales.float(), biases.float()
        h = 1 << (bits - 1)
        sz = torch.stack([s32, b32 + h * s32], dim=-1)  # (N, K/group, 2)
        if bits <= 4:
            codes = codes + (8 - h)
        else:
            codes = torch.cat([codes & 15, (codes >> 4) + (8 - h // 16)], dim=1)  # (N, 2K)
            high = torch.stack([16 * s32, 8 * s32], dim=-1)
            sz = torch.cat([sz, high], dim=1)  # (N, 2K/group, 2)
        int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        return int4, sz.transpose(0, 1).contiguous().to(dtype)  # (K'/group, N, 2)

    return _repacked("int4", packed, scales, biases, dtype, build)


def _int4_mm(x: Any, packed: Any, scales: Any, biases: Any, *, bits: int, group_size: int) -> Any:
    int4, sz = _int4_pack(packed, scales, biases, x.dtype, bits)
    return _int4_run(x, int4, sz, bits=bits, group_size=group_size)


def _int4_run(x: Any, int4: Any, sz: Any, *, bits: int, group_size: int) -> Any:
    """The int4 kernel on repacked arrays (:func:`_int4_pack`): ``(N.., K)`` -> ``(N.., N)``."""
    flat = x.reshape(-1, x.shape[-1])  # (M, K)
    if bits > 4:
        flat = torch.cat([flat, flat], dim=-1)  # (M, 2K): the two nibble planes
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, int4, group_size, sz)  # (M, N)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _int4_decode(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> bool | None:
    """Whether :func:`quantized_linear` runs the int4 kernel on these rows (bfloat16 at every
    width: True), dequantizes first (a bfloat16 prompt of more than :data:`_DENSE_FROM` rows,
    also where the int4 kernel does not apply, e.g. groups of 16: False), or takes neither
    (``None``)."""
    if x.dtype != torch.bfloat16 or packed.ndim != 2 or x.device.type != "cpu":
        return None
    if x.numel() // x.shape[-1] > _DENSE_FROM[bits] and scales.dtype == x.dtype:
        return False
    fmt = {"bits": bits, "group_size": group_size}
    return True if _int4_applies(x, packed, scales, biases, bias, **fmt) else None


# 8-bit: torch's int8 kernel takes one scale per output channel, so it runs once per group g
# (whose scales are per channel): y = sum_g int8_mm(x_g, q_g - 128, s_g) + sum(x_g) (b + 128 s).
# The signed codes are repacked once, group-major: (G, N, group_size) int8.
def _int8_applies(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> bool:
    return (
        bits == 8
        and packed.ndim == 2
        and sys.byteorder == "little"  # the codes are read as the words' bytes
        and x.device.type == "cpu"
        and scales.dtype == x.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and hasattr(torch.ops.aten, "_weight_int8pack_mm")
    )


def _int8_pack(packed: Any, scales: Any, biases: Any, dtype: Any) -> tuple[Any, ...]:
    def build() -> tuple[Any, Any, Any]:
        n, k = packed.shape[0], packed.shape[1] * 4
        g = scales.shape[1]
        codes = packed.view(torch.uint8) ^ 128  # q ^ 0x80 read as int8 is q - 128
        codes = codes.view(torch.int8).reshape(n, g, k // g).transpose(0, 1)  # (G, N, gs)
        # Each group's codes and scales padded to a whole number of the kernel's blocks of
        # output rows: at N not a multiple of 64, torch 2.13's _weight_int8pack_mm read past the
        # end of its weight (a segfault, depending on what lay there: seen at N = 8, 16, 32, 48)
        pad = -n % _INT8_BLOCK_N
        codes = torch.nn.functional.pad(codes, (0, 0, 0, pad)).contiguous()  # (G, N + pad, gs)
        s32 = scales.float()
        zeros = (biases.float() + 128 * s32).T.contiguous()  # (G, N), float32
        s = torch.nn.functional.pad(scales.T, (0, pad)).contiguous()  # (G, N + pad), x's dtype
        return codes, zeros, s

    return _repacked("int8", packed, scales, biases, dtype, build)


# float32, one token, 8-bit group 32, process time: the per-group calls cost more than the byte
# path's widening below this many output rows (1536x576: 0.82 against 0.33 ms), and win above
# it (4864x896: 3.3 against 3.4 ms; the 49152x576 LM head: 20 against 72 ms).
_INT8_MIN_N = 4096
#: The output rows _int8_pack pads each group's codes to a multiple of (see there).
_INT8_BLOCK_N = 64


def _int8_grouped(x: Any, packed: Any, scales: Any, biases: Any, *, group_size: int) -> Any:
    codes, zeros, s = _int8_pack(packed, scales, biases, x.dtype)
    g, n = codes.shape[0], zeros.shape[1]
    xg = x.reshape(-1, g, group_size)  # (M, G, gs)
    y = xg.sum(-1, dtype=torch.float32) @ zeros  # (M, N), float32
    for i in range(g):  # each group's partial product rounded once to x's dtype
        y += torch.ops.aten._weight_int8pack_mm(xg[:, i].clone(), codes[i], s[i])[:, :n]
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def _bytes_applies(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> bool:
    """The byte-unpacked grouped product: 4- and 8-bit codes read as the bytes of the words
    (little-endian, so byte j of a row holds codes 2j and 2j+1, or code j), float32/float64 x
    with scales of its dtype (the weight is never rounded to another dtype)."""
    return (
        bits in (4, 8)
        and packed.ndim == 2
        and sys.byteorder == "little"
        and x.dtype in (torch.float32, torch.float64)
        and scales.dtype == x.dtype
    )


def _quantized_applies(*args: Any, **fmt: Any) -> bool:
    return (
        _int8_applies(*args, **fmt) or _int4_applies(*args, **fmt) or _bytes_applies(*args, **fmt)
    )


def _few_rows(x: Any, scales: Any, group_size: int) -> bool:
    return x.numel() // x.shape[-1] * _BYTE_ROWS <= group_size


def _quantized_prefer(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> bool:
    # bfloat16: the int4 or int8 kernel; float32/float64: the int8 kernel or the byte path for
    # few rows (decode), where they beat the portable grouped path; more rows go to the portable
    # dequantize-then-matmul.
    return x.dtype == torch.bfloat16 or _few_rows(x, scales, group_size)


def _specialize_quantized(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> Any:
    """quantized_linear for a weight a model binds once (``Native.specialize``): where
    :func:`quantized_linear` runs the int4 kernel for activations like ``x`` (bfloat16, decode
    rows), that call with the repack and the checks done now, the same bits; else ``None``.
    Decoding SmolLM2 in bfloat16 with its codes kept (1 thread, idle 2-core VM, A/B in one
    process) ran 1.06-1.09x faster at Q4_1, 1.08x at Q8_0: the checks and the repack's lookup
    cost about 4 us of a 15 us call."""
    fmt = {"bits": bits, "group_size": group_size}
    if not _int4_decode(x, packed, scales, biases, bias, **fmt):
        return None
    int4, sz = _int4_pack(packed, scales, biases, x.dtype, bits)

    def run(xp: Any, x: Any, b: Any) -> Any:
        y = _int4_run(x, int4, sz, **fmt)
        return y if b is None else y + b

    return run


@native(
    "torch",
    "quantized_linear",
    kernel="torch.ops.aten._weight_int4pack_mm_for_cpu | _weight_int8pack_mm | torch.bmm",
    applies=_quantized_applies,
    # bfloat16 is the int4 kernel's fast path for every width (2-core CPU, min of 15 runs, one
    # token, 4-bit 1536x576: 39 us against the portable path's 1.5 ms and a dense bfloat16
    # linear's 69 us; 5-8 bits as two nibble planes: 2x the 4-bit time, SmolLM2 Q8_0's whole
    # decode 1.6x its dequantized bfloat16 floats, benchmarks/README.md issue 21); in float32
    # and float16 it ran 10-100x slower, and float32 activations rounded to bfloat16 for it miss
    # float32's tolerance (rtol 1e-5) by far, so float32 takes the byte path (exact to float32
    # accumulation). Rounding of the int4 kernel: 5e-3 of the largest output in bfloat16 (about
    # twice the portable path), within its tolerance.
    auto_dtypes=("bfloat16", "float32", "float64"),
    prefer=_quantized_prefer,
    specialize=_specialize_quantized,
)
def quantized_linear(
    xp: Any, x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int,
    group_size: int,
) -> Any:  # fmt: skip
    fmt = {"bits": bits, "group_size": group_size}
    planes = _int4_decode(x, packed, scales, biases, bias, **fmt)
    if planes is False:
        # a prompt: the kernel re-decodes the codes per few rows (128 rows of SmolLM2's
        # 1536x576: 8-bit 18 ms, 4-bit 7 ms, against 2.5-6 ms for the bytes dequantized once,
        # then a dense product)
        w = _dense_weight(packed, scales, biases, bits=bits, group_size=group_size)
        return F.linear(x, w, bias)
    if planes:
        y = _int4_mm(x, packed, scales, biases, **fmt)
        return y if bias is None else y + bias
    if _int8_applies(x, packed, scales, biases, bias, **fmt) and (
        x.dtype == torch.bfloat16
        or packed.shape[0] >= _INT8_MIN_N
        or not _bytes_applies(x, packed, scales, biases, bias, **fmt)
    ):
        y = _int8_grouped(x, packed, scales, biases, group_size=group_size)
        return y if bias is None else y + bias
    if _bytes_applies(x, packed, scales, biases, bias, **fmt) and (
        _few_rows(x, scales, group_size)
        or not _int4_applies(x, packed, scales, biases, bias, **fmt)
    ):
        y = _bytes_grouped(x, packed, scales, biases, bits=bits, group_size=group_size)
        return y if bias is None else y + bias
    y = _int4_mm(x, packed, scales, biases, **fmt)
    return y if bias is None else y + bias


#: bits -> from more rows than this, bfloat16 products dequantize (_dense_weight) first
#: (measured crossings, 2-core CPU at load 10, 2048x640 and 1536x576: 8 bits (the codes are
#: the bytes) below 16 rows; 4 bits near 64; 5 and 6 bits between 32 and 128 (128 rows: 13 ms
#: against the kernel's 24-30); 3 bits near 128).
_DENSE_FROM = {2: 96, 3: 96, 4: 64, 5: 64, 6: 64, 8: 16}


def _dense_weight(packed: Any, scales: Any, biases: Any, *, bits: int, group_size: int) -> Any:
    """The dequantized weight ``(N, K)`` in scales' dtype, rounded as ops.quant.dequantize
    rounds it (the codes cast, times the scale, plus the bias, each step in that dtype)."""
    n = packed.shape[0]
    by = packed.view(torch.uint8)
    if bits == 4:  # byte j holds codes 2j and 2j + 1 (low, high nibble)
        by = torch.stack([by & 15, by >> 4], dim=-1)  # (N, K/2, 2)
    elif bits != 8:
        by = _codes(packed, bits)  # (N, K)
    q = by.reshape(n, -1, group_size).to(scales.dtype)  # (N, G, gs)
    return (q * scales[..., None] + biases[..., None]).reshape(n, -1)


def _bytes_grouped(
    x: Any, packed: Any, scales: Any, biases: Any, *, bits: int, group_size: int
) -> Any:
    """The portable grouped product (ops.quant.kernels._quantized_linear_grouped) with the codes
    read as bytes: two uint8 masks for 4 bits, none for 8, instead of int32 shifts (measured 2-3x
    faster per decode projection on a 2-core CPU, process time, one thread)."""
    n, k = packed.shape[0], x.shape[-1]
    g = k // group_size
    by = packed.view(torch.uint8).reshape(n, g, group_size * bits // 8)  # (N, G, bytes/group)
    xg = x.reshape(-1, g, group_size).transpose(0, 1)  # (G, M, gs)
    # Centred codes q - c with the bias b + c * s, as the portable grouped path (less
    # cancellation between the two sums); centred in int8 before widening (15-20% more time
    # than uncentred codes, measured; a float subtraction cost 25-40%).
    c = 1 << (bits - 1)
    if bits == 8:
        centred = (by ^ 128).view(torch.int8)  # q ^ 0x80 read as int8 is q - 128
        dots = torch.bmm(xg, centred.to(x.dtype).permute(1, 2, 0))  # (G, M, N)
    else:  # the low nibble of byte j is code 2j, the high nibble code 2j + 1
        lo = ((by & 15).view(torch.int8) - c).to(x.dtype).permute(1, 2, 0)  # (G, gs/2, N)
        hi = ((by >> 4).view(torch.int8) - c).to(x.dtype).permute(1, 2, 0)
        dots = torch.bmm(xg[..., 0::2].contiguous(), lo) + torch.bmm(xg[..., 1::2].contiguous(), hi)
    y = (dots * scales.T[:, None, :]).sum(0) + xg.sum(-1).T @ (biases + c * scales).T  # (M, N)
    return y.reshape(*x.shape[:-1], n)


# -- paged attention (portable_llm.attn.paged) -------------------------------------------------
# The pages a batch uses are gathered into contiguous keys, then attended by the SDPA kernel
# above with the per-row causal mask of the options record (opts: attn.paged_args.PagedOptions).
# Where the arguments come with a page map (decode over a mostly used pool), the pool-wide
# path of attn.paged_pool instead, its steps written in place.


def _paged_gather(pages: Any, tables: Any) -> Any:
    """``(N, H_kv, P, D)`` pages, ``(B, M)`` table -> ``(B, H_kv, M * P, D)``: one copy.

    Advanced indexing of the head-major view: ``index_select``, which the Array API ``take``
    maps to, is ~4x slower on that non-contiguous view (measured, 8 MiB of pages).
    """
    B, M = tables.shape
    _, H, P, D = pages.shape
    g = pages.permute(1, 0, 2, 3)[:, tables.reshape(-1).long()]  # (H_kv, B * M, P, D)
    return g.view(H, B, M * P, D).permute(1, 0, 2, 3)  # (B, H_kv, S, D)


def _paged_applies(
    q: Any, k_pages: Any, v_pages: Any, tables: Any, lens: Any, page_map: Any, sinks: Any = None,
    *, opts: Any,
) -> bool:  # fmt: skip
    return _sdpa_applies(q, k_pages, v_pages, None, sinks, opts=opts.sdpa)  # sinks: refused


def _paged_pool(q: Any, k_pages: Any, v_pages: Any, lens: Any, tables: Any, page_map: Any,
                opts: Any) -> Any:  # fmt: skip
    """The pool-wide path (:mod:`portable_llm.attn.paged_pool`, the same steps and sums) with
    the mask, the shift by each row's max and the exponential written over the scores, and
    ``torch.bmm`` over the pool's pages: ~20% less time than the portable path (no new array
    per step; measured interleaved, 4 rows of 2048 keys, H=32, H_kv=8, D=64, pages of 16)."""
    B, H, L, D = q.shape
    N, h_kv, P, _ = k_pages.shape
    G, M = H // h_kv, tables.shape[1]
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.reshape(B, h_kv, G * L, D).to(cd) * opts.sdpa.scale  # (B, H_kv, G*L, D)
    owner, first = page_map[0].long(), page_map[1]  # (N,): each page's row, first position
    qo = qg.index_select(0, owner).view(N * h_kv, G * L, D)  # each page's row's queries
    k = k_pages.to(cd).view(N * h_kv, P, D)
    s = torch.bmm(k, qo.transpose(1, 2)).transpose(1, 2).contiguous()  # (N*H_kv, G*L, P)
    ok = opts.mask(torch, lens.index_select(0, owner), L, P, first.view(N, 1, 1), q.device)
    s = s.view(N, h_kv, G, L, P).masked_fill_(~ok.view(N, 1, 1, L, P), -math.inf)
    s = s.view(N, h_kv, G * L, P)
    m = s.amax(-1, keepdim=True)  # (N, H_kv, G*L, 1)
    used = torch.arange(M, device=q.device) < ((lens + (P - 1)) // P).view(B, 1)  # (B, M)
    mr = m.index_select(0, tables.reshape(-1).long()).view(B, M, h_kv, G * L, 1)
    top = mr.masked_fill_(~used.view(B, M, 1, 1, 1), -math.inf).amax(1)  # (B, H_kv, G*L, 1)
    p = s.sub_(top.index_select(0, owner)).exp_()  # (N, H_kv, G*L, P); 0 where hidden
    part = torch.bmm(p.view(N * h_kv, G * L, P), v_pages.to(cd).view(N * h_kv, P, D))
    rows = torch.arange(B, device=q.device).view(B, 1)
    sel = ((owner.view(1, N) == rows) & (first.view(1, N) < _UNUSED)).to(cd)  # (B, N)
    acc = torch.mm(sel, part.view(N, h_kv * G * L * D)).view(B, h_kv, G * L, D)
    tot = torch.mm(sel, p.view(N, h_kv * G * L * P)).view(B, h_kv, G * L, P).sum(-1, True)
    return acc.div_(tot).view(B, H, L, D).to(q.dtype)


_UNUSED = 1 << 30  # attn.paged_args.UNUSED: the first position of a page no row uses


@native(
    "torch",
    "paged_attention",
    kernel="torch indexing + torch.nn.functional.scaled_dot_product_attention; with a page "
    "map: the pool-wide path in place (torch.bmm)",
    applies=_paged_applies,
)
def paged_attention(
    xp: Any,
    q: Any,
    k_pages: Any,
    v_pages: Any,
    tables: Any,
    lens: Any,
    page_map: Any,
    *,
    opts: Any,
) -> Any:
    if page_map is not None:
        return _paged_pool(q, k_pages, v_pages, lens, tables, page_map, opts)
    k, v = _paged_gather(k_pages, tables), _paged_gather(v_pages, tables)  # (B, H_kv, S, D)
    mask = opts.mask(xp, lens, q.shape[2], k.shape[2], 0, q.device)  # (B, 1, L, S)
    return scaled_dot_product_attention(xp, q, k, v, mask, opts=opts.sdpa)


# -- quantized codes times 8-bit activations (activations="int8"): numba's kernel --------------
# CPU tensors through their buffers (x, scales and biases read as float32 NumPy arrays, the
# packed codes as they are); not where autograd, dynamo or a torch.func transform sees the
# tensors (NumPy is outside their graphs). Inside the compiled decode step's trace (make_fx over
# real tensors, native/torch_compile.py) the kernel is the custom op below, which the graph
# records as one node: the weight prepacked at the trace, its arrays the program's constants.


def _numba_int8_applies(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> bool:
    return (
        numba_cpu.int8_applies(bits, group_size)
        and packed.ndim == 2
        and x.device.type == "cpu"
        and packed.device.type == "cpu"
        and x.dtype != torch.float64
        and not (torch.is_grad_enabled() and x.requires_grad)
        and not torch.compiler.is_compiling()
        and not _functorch_wrapped(x)
    )


def _host(t: Any) -> Any:
    """A CPU tensor's float32 values as a NumPy array (its buffer where it is float32)."""
    return t.detach().to(torch.float32).numpy()


def _numba_int8_prepack(
    packed: Any, scales: Any, biases: Any, *, bits: int, group_size: int
) -> numba_cpu.Prepacked:
    p = packed.detach().numpy()
    return numba_cpu.prepack(p, _host(scales), _host(biases), bits=bits, group_size=group_size)


# Registered with torch.library's low-level Library (a schema and a CPU kernel) rather than
# torch.library.custom_op, whose Python layers (autograd, the op object's own dispatch) cost
# ~100 us a call here against ~40 us (load 10, a 64x32 weight): a decode step calls it 211 times.
_LIB = torch.library.Library("portable_llm", "DEF")
_LIB.define(
    "quantized_linear_int8(Tensor x, Tensor w, Tensor s, Tensor b, int block, int n) -> Tensor"
)


def _int8_op_cpu(x: Any, w: Any, s: Any, b: Any, block: int, n: int) -> Any:
    """numba's kernel as a torch op (``numba_cpu.run``): float32 ``x`` ``(M, K)`` times a
    prepacked weight (``w``, ``s``, ``b``: :class:`~portable_llm.native.numba_cpu.Prepacked`'s
    arrays as tensors; uint8 ``w``: nibbles) -> ``(M, n)`` float32, contiguous."""
    pre = numba_cpu.Prepacked(w.numpy(), s.numpy(), b.numpy(), n, block, w.dtype == torch.uint8)
    y = numba_cpu.run(pre, np.ascontiguousarray(x.numpy()))  # (M, n)
    return torch.from_numpy(y if y.flags.c_contiguous else np.ascontiguousarray(y))


_LIB.impl("quantized_linear_int8", _int8_op_cpu, "CPU")


@torch.library.register_fake("portable_llm::quantized_linear_int8", lib=_LIB)
def _int8_op_fake(x: Any, w: Any, s: Any, b: Any, block: int, n: int) -> Any:
    return x.new_empty((x.shape[0], n), dtype=torch.float32)


#: The op (``torch.ops.portable_llm.quantized_linear_int8``), as a graph records it.
int8_op = torch.ops.portable_llm.quantized_linear_int8.default


def _int8_op_run(pre: numba_cpu.Prepacked, x: Any, bias: Any) -> Any:
    """:func:`_numba_int8_run` as a graph records it: the custom op, then torch ops."""
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    arrays = (torch.from_numpy(pre.w), torch.from_numpy(pre.s), torch.from_numpy(pre.b))
    xf = x.reshape(-1, k).to(torch.float32).contiguous()  # (M, K)
    y = int8_op(xf, *arrays, pre.block, pre.n)  # (M, O)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*lead, pre.n)  # (N.., O)


def _numba_int8_run(pre: numba_cpu.Prepacked, x: Any, bias: Any) -> Any:
    if traced():  # the compiled step's trace: one node of its graph
        return _int8_op_run(pre, x, bias)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    if x.dtype == torch.float32 and x.is_contiguous() and not x.requires_grad:
        # a decode step's case: NumPy views both ways, no torch op (each costs 2-6 us of
        # dispatch: a bound SmolLM2 step ran 6697 of them for 211 projections)
        y = numba_cpu.run(pre, x.numpy().reshape(-1, k))  # (M, O)
        if bias is not None:
            y += bias.numpy() if bias.dtype == torch.float32 else _host(bias)
        return torch.from_numpy(y.reshape(*lead, pre.n))  # (N.., O)
    yt = torch.from_numpy(numba_cpu.run(pre, _host(x.reshape(-1, k).contiguous())))  # (M, O)
    if bias is not None:
        yt += bias.to(torch.float32)
    return yt.to(x.dtype).reshape(*lead, pre.n)  # (N.., O)


def _numba_int8_specialize(
    x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int, group_size: int
) -> Any:
    """The kernel for a weight bound once: repacked now (once per weight: the compiled step's
    trace finds the same), then one compiled call a product."""
    if _numba_int8_dense(x):
        return None  # the call's dense route: no repack to keep
    fmt = {"bits": bits, "group_size": group_size}
    build = functools.partial(_numba_int8_prepack, packed, scales, biases, **fmt)
    pre = numba_cpu.prepacked(packed, scales, biases, build)

    def run(xp: Any, x: Any, b: Any) -> Any:
        return _numba_int8_run(pre, x, b)

    return run


@native(
    "torch",
    "quantized_linear_int8",
    kernel="numba: int16/int32 dots of Q8_0 blocks with codes repacked across 64 output rows",
    applies=_numba_int8_applies,
    specialize=_numba_int8_specialize,
)
def quantized_linear_int8(
    xp: Any, x: Any, packed: Any, scales: Any, biases: Any, bias: Any, *, bits: int,
    group_size: int,
) -> Any:  # fmt: skip
    fmt = {"bits": bits, "group_size": group_size}
    if _numba_int8_dense(x):  # a prompt: the Q8_0 blocks' values times the float32 weight
        lead, k = tuple(x.shape[:-1]), x.shape[-1]
        xv = numba_cpu.q8_values(_host(x.reshape(-1, k).contiguous()),
                                 numba_cpu.activation_block(group_size))  # fmt: skip
        w = _dense_weight(packed, scales.to(torch.float32), biases.to(torch.float32), **fmt)
        y = F.linear(torch.from_numpy(xv), w, None if bias is None else bias.to(torch.float32))
        return y.to(x.dtype).reshape(*lead, y.shape[-1])  # (N.., O)
    build = functools.partial(_numba_int8_prepack, packed, scales, biases, **fmt)
    return _numba_int8_run(numba_cpu.prepacked(packed, scales, biases, build), x, bias)


def _numba_int8_dense(x: Any) -> bool:
    """Whether a product of these rows takes the dense route (``numba_cpu.q8_values``): not
    inside a compiled step's trace, which records the kernel's custom op for any rows."""
    return x.numel() // x.shape[-1] >= numba_cpu.PREFILL_ROWS and not traced()


def _conv_prefer(u: Any, weight: Any) -> bool:
    return bool(u.shape[1] > weight.shape[1])  # L > 1 tokens: one token takes the window


# short_conv: the depthwise convolution as a grouped F.conv1d (HF causal_conv1d_fn's call) in
# float32 (float64 for float64); the op adds the bias and activation and rounds once.
@native("torch", "short_conv", kernel="torch.nn.functional.conv1d(groups=C)", prefer=_conv_prefer)
def short_conv(xp: Any, u: Any, weight: Any) -> Any:
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    w = weight.to(compute)[:, None, :]  # (C, 1, K)
    y = F.conv1d(u.to(compute).transpose(1, 2), w, groups=w.shape[0])  # (B, C, L)
    return y.transpose(1, 2)  # (B, L, C)
