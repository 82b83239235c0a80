"""MXFP4 (gpt-oss's experts): MXFP4Weight, its dequantize and quantized_linear kernels, the
loaders of transformers' ``*_blocks``/``*_scales`` and of GGUF's ``MXFP4`` tensors.

Values against the float64 reference of the format (``reference.mxfp4_dequantize``: the
E2M1 fields decoded from the bits, ``2 ** (e - 127)``), exact for the dequantized weight in
every dtype whose range holds it; the products within the tolerance table on every backend and
path (MLX's ``mx.quantized_matmul(mode="mxfp4")``, the portable dequantize-and-multiply);
properties: a block's scale multiplies its 32 weights only, ``linear``, ``mlp`` and ``moe``
take the weight as they take a QuantizedWeight; the loaders against gguf-py's own decoder and
the reference; bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.checkpoint.mxfp4 import mxfp4_from_blocks, mxfp4_from_ggml, read_gguf_mxfp4
from portable_llm.ops.quant.mxfp4 import FP4_E2M1
from portable_llm.testing import assert_close, random_array, reference
from portable_llm.testing.strategies import mxfp4_shapes, seeds


def _codes(seed: int, shape: tuple[int, ...], low: int = 120, high: int = 134) -> tuple:
    """Random codes ``(.., N, K)`` and exponents ``(.., N, K / 32)`` (``2 ** -7 .. 2 ** 6``:
    every dtype holds the weights exactly), packed as MXFP4Weight holds them."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, shape).astype(np.uint32)
    e = rng.integers(low, high, (*shape[:-1], shape[-1] // 32)).astype(np.uint8)
    shifts = (4 * np.arange(8)).astype(np.uint32)
    packed = (codes.reshape(*shape[:-1], -1, 8) << shifts).sum(-1, dtype=np.uint32)
    return packed, e


def _weight(packed, e, dtype: str, backend: str) -> pl.MXFP4Weight:
    return pl.MXFP4Weight(pl.asarray(packed, backend=backend), pl.asarray(e, backend=backend),
                          dtype=dtype)  # fmt: skip


@given(shape=mxfp4_shapes(), seed=seeds())
def test_dequantize_is_the_format_exactly(backend, dtype, shape, seed):
    packed, e = _codes(seed, shape)
    w = pl.dequantize(_weight(packed, e, dtype, backend))
    assert_close(w, reference.mxfp4_dequantize(packed, e), rtol=0, atol=0, backend=backend,
                 dtype=dtype)  # fmt: skip


@given(shape=mxfp4_shapes(max_dims=2), seed=seeds(),
       impl=st.sampled_from(["auto", "portable", "lut"]), bias=st.booleans(),
       rows=st.sampled_from([(1,), (3,), (2, 5)]))  # fmt: skip
def test_quantized_linear_matches_reference(backend, dtype, shape, seed, impl, bias, rows):
    packed, e = _codes(seed, shape)
    x, xr = random_array(seed, (*rows, shape[-1]), dtype, backend=backend, scale=1 / 32)
    b, br = random_array(seed + 1, (shape[0],), dtype, backend=backend) if bias else (None, None)
    qw = _weight(packed, e, dtype, backend)
    out = pl.quantized_linear(x, qw, b, impl=impl)
    assert_close(out, reference.mxfp4_linear(xr, packed, e, br), backend=backend, dtype=dtype)


def test_the_native_kernel_equals_the_portable_path(backend, dtype):
    # MLX: mx.quantized_matmul(mode="mxfp4"); elsewhere native is refused (no such kernel).
    packed, e = _codes(5, (48, 128))
    x = random_array(5, (4, 128), dtype, backend=backend, scale=1 / 32)[0]
    qw = _weight(packed, e, dtype, backend)
    if backend != "mlx":
        with pytest.raises(ValueError, match="quantized_linear_mxfp4"):
            pl.quantized_linear(x, qw, impl="native")
        return
    with pl.trace() as t:
        auto = pl.quantized_linear(x, qw)
    assert [e.impl for e in t] == ["lut" if dtype == "float64" else "native"]  # 4 rows
    native = pl.quantized_linear(x, qw, impl="native")
    portable = pl.quantized_linear(x, qw, impl="portable")
    assert_close(native, pl.to_numpy(portable), backend=backend, dtype=dtype)
    assert_close(auto, pl.to_numpy(portable), backend=backend, dtype=dtype)


@pytest.mark.parametrize(("rows", "dtype", "want"), [
    ((1,), "float32", "lut"), ((2, 2), "float64", "lut"), ((5,), "float32", "portable"),
    ((1,), "bfloat16", "portable"),
])  # fmt: skip
def test_auto_takes_the_pair_table_for_a_few_wide_rows(rows, dtype, want):
    """A decode step's few float32/float64 rows multiply through the pair table (no weight
    formed); more rows, or a half dtype (whose product of the weight rounded to x's dtype MLX
    keeps), dequantize. The same numbers either way, within the tolerance table."""
    packed, e = _codes(6, (8, 64))
    x = random_array(6, (*rows, 64), dtype, backend="numpy", scale=1 / 32)[0]
    qw = _weight(packed, e, dtype, "numpy")
    with pl.trace() as t:
        auto = pl.quantized_linear(x, qw)
    assert [entry.impl for entry in t] == [want]
    other = pl.quantized_linear(x, qw, impl="portable" if want == "lut" else "lut")
    assert_close(auto, other, dtype=dtype)


def test_each_block_has_its_own_scale(backend):
    # Raising one block's exponent by 3 multiplies exactly its 32 weights by 8.
    packed, e = _codes(1, (4, 96))
    w = pl.to_numpy(pl.dequantize(_weight(packed, e, "float32", backend)))
    e2 = e.copy()
    e2[2, 1] += 3
    w2 = pl.to_numpy(pl.dequantize(_weight(packed, e2, "float32", backend)))
    want = w.copy()
    want[2, 32:64] *= 8
    np.testing.assert_array_equal(w2, want)


def test_the_sixteen_codes_and_the_edge_exponents(backend):
    # Codes 0..15 are E2M1's values; e = 0 is 2**-127 (subnormal in float32), e = 254 2**127,
    # e = 255 2**128: finite in float64, infinite in float32 (0 * inf = NaN), as MLX reads it.
    packed = np.array([[0x76543210, 0xFEDCBA98, 0, 0]] * 4, np.uint32)  # codes 0..15, then 0s
    e = np.array([[127], [0], [254], [255]], np.uint8)
    for dtype in pl.get_backend(backend).float_dtypes():
        if dtype not in ("float32", "float64"):
            continue
        with np.errstate(over="ignore", invalid="ignore"):  # NumPy's warnings for 6 * 2**128
            w = pl.to_numpy(pl.dequantize(_weight(packed, e, dtype, backend)))
        np.testing.assert_array_equal(w[0, :16], np.array(FP4_E2M1))
        np.testing.assert_array_equal(np.signbit(w[0, :16]), np.arange(16) >= 8)
        want = reference.mxfp4_dequantize(packed, e)
        if dtype == "float64":
            np.testing.assert_array_equal(w, want)
        else:
            with np.errstate(over="ignore"):  # e = 254: 4 * 2**127 and up are inf in float32
                want32 = want[:3].astype(np.float32)
            if backend == "jax":  # XLA's CPU code flushes the subnormal scale 2**-127 to zero
                want32[1] = 0.0 * want32[1]
            np.testing.assert_array_equal(w[:3], want32)
            np.testing.assert_array_equal(w[3, 1:8], np.full(7, np.inf, np.float32))
            assert np.isnan(w[3, 0]) and np.isnan(w[3, 16])  # 0 * 2**128 in float32


def test_linear_mlp_and_moe_take_mxfp4_weights(backend):
    # As a QuantizedWeight: linear and mlp multiply through quantized_linear, moe dequantizes
    # its experts for the call; each equals the same op on the dequantized weights.
    X, E, inter = 4, 64, 32
    ws = [_weight(*_codes(10 + j, shape, 118, 124), "float32", backend)  # weights O(1)
          for j, shape in enumerate([(X, inter, E), (X, inter, E), (X, E, inter)])]  # fmt: skip
    dense = [pl.dequantize(w) for w in ws]
    x = random_array(3, (2, 3, E), "float32", backend=backend)[0]
    router = random_array(4, (X, E), "float32", backend=backend)[0]
    assert_close(
        pl.linear(x, ws[0][1]), pl.to_numpy(pl.linear(x, dense[0][1, ...])), backend=backend
    )
    mlp = pl.mlp(x, ws[0][0], ws[1][0], ws[2][0])
    assert_close(mlp, pl.to_numpy(pl.mlp(x, dense[0][0, ...], dense[1][0, ...], dense[2][0, ...])),
                 backend=backend)  # fmt: skip
    kw = {"top_k": 2, "swiglu_limit": 7.0, "swiglu_alpha": 1.702}  # gpt-oss's experts
    got = pl.moe(x, router, *ws, **kw)
    assert_close(got, pl.to_numpy(pl.moe(x, router, *dense, **kw)), backend=backend)


def test_bytes_per_weight():
    packed, e = _codes(0, (8, 256))
    qw = _weight(packed, e, "bfloat16", "numpy")
    assert qw.nbytes == packed.nbytes + e.nbytes == 8 * 256 * 17 // 32  # 4.25 bits a weight
    assert (qw.shape, qw.bits, qw.group_size) == ((8, 256), 4, 32)


# -- the loaders --------------------------------------------------------------------------------


def test_transformers_blocks_and_scales(backend):
    # gpt-oss's layout: (.., N, K / 32, 16) bytes, c_2j in the low nibble of byte j.
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (3, 8, 4, 16), dtype=np.uint8)  # (X, N, K / 32, 16)
    e = rng.integers(118, 136, (3, 8, 4), dtype=np.uint8)
    qw = mxfp4_from_blocks(blocks, e, dtype="float32", backend=backend)
    assert qw.shape == (3, 8, 128)
    lut = np.array(FP4_E2M1)  # HF's own decoding: lut[low], lut[high] interleaved, ldexp
    vals = np.stack([lut[blocks & 0x0F], lut[blocks >> 4]], axis=-1).reshape(3, 8, 4, 32)
    want = np.ldexp(vals, e[..., None].astype(np.int32) - 127).reshape(3, 8, 128)
    assert_close(pl.dequantize(qw), want.astype(np.float32), rtol=0, atol=0, backend=backend)


def test_gguf_mxfp4_tensor_written_with_gguf_py(backend, tmp_path):
    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (extra: gguf)")
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((2, 6, 64)) * rng.uniform(0.01, 10, (2, 6, 1))).astype(np.float32)
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)  # (2, 6, 2 * 17) bytes
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt-oss")
    writer.add_tensor("blk.0.ffn_down_exps.weight", data,
                      raw_dtype=gguf.GGMLQuantizationType.MXFP4)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    qw = read_gguf_mxfp4(tmp_path / "m.gguf", "blk.0.ffn_down_exps.weight", backend=backend)
    assert qw.shape == (2, 6, 64)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.MXFP4)  # gguf-py's decoder
    assert_close(pl.dequantize(qw), want.astype(np.float32), rtol=0, atol=0, backend=backend)
    assert_close(pl.dequantize(qw), reference.mxfp4_dequantize(*(pl.to_numpy(a) for a in
                 qw.arrays)), rtol=0, atol=0, backend=backend, dtype="float32")  # fmt: skip
    with pytest.raises(pl.CheckpointError, match="has no tensor 'nope'"):
        read_gguf_mxfp4(tmp_path / "m.gguf", "nope")


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda p, e: pl.MXFP4Weight(p.astype(np.int32), e), TypeError,
         r"MXFP4Weight: packed must have dtype uint32, got int32 with shape \(4, 8\)"),
        (lambda p, e: pl.MXFP4Weight(p, e.astype(np.float32)), TypeError,
         r"scales must have dtype uint8, got float32"),
        (lambda p, e: pl.MXFP4Weight(p, e[:, :1]), ValueError,
         r"packed \(4, 8\) holds K = 64 codes per row, in blocks of 32: scales must have shape "
         r"\(4, 2\) \(.. x N x K/32\), got \(4, 1\)"),
        (lambda p, e: pl.MXFP4Weight(p[:, :3], e), ValueError, r"K = 24 codes per row"),
        (lambda p, e: pl.MXFP4Weight(p, e, dtype="int8"), TypeError, r"dtype must be one of"),
        (lambda p, e: pl.quantized_linear(np.ones((2, 32), np.float32), pl.MXFP4Weight(p, e)),
         ValueError, r"qw must have shape \(O, 32\)"),
        (lambda p, e: pl.quantized_linear(np.ones((2, 64), np.float32), pl.MXFP4Weight(p, e),
                                          activations="int8"),
         ValueError, r"an MXFP4Weight takes activations='float' only"),
        (lambda p, e: mxfp4_from_blocks(np.zeros((4, 2, 8), np.uint8), e), ValueError,
         r"blocks must have shape \(.., N, K/32, 16\)"),
        (lambda p, e: mxfp4_from_ggml(np.zeros(30, np.uint8), (1, 32)), ValueError,
         r"30 bytes do not hold a weight of shape \(1, 32\)"),
    ],
)  # fmt: skip
def test_bad_input(make, error, match):
    packed, e = _codes(0, (4, 64))
    with pytest.raises(error, match=match):
        make(packed, e)
