"""Quantized weights times 8-bit activations (``quantized_linear(..., activations="int8")``).

The portable path against the float64 reference of the same definition (the activations'
Q8_0 blocks formed in the op's compute precision, everything after in float64), numba's kernel
against the portable path, the bound on the difference from the exact mode that the rounding
of the activations allows, and bad input.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.core.dispatch import dispatcher
from portable_llm.native import numba_cpu
from portable_llm.native.numba_cpu import PREFILL_ROWS
from portable_llm.ops.quant import QuantizedWeight, quantize
from portable_llm.ops.quant import quantized_linear as qlinear
from portable_llm.ops.quant.codes import pack_codes
from portable_llm.ops.quant.int8 import quantize_activations
from portable_llm.testing import assert_close, random_array, random_weight, reference, tolerance
from portable_llm.testing.strategies import seeds

INT8_BITS = st.sampled_from([2, 3, 4, 8])
GROUPS = st.sampled_from([16, 32, 64])


def _case(backend: str, dtype: str, bits: int, group: int, rows: int, seed: int):
    k = 2 * math.lcm(group, 32)  # whole blocks of 32 codes at 3 bits, two groups at least
    x, x64 = random_array(seed, (rows, k), dtype, backend=backend)
    w, _ = random_weight(seed + 1, (24, k), dtype, backend=backend)
    qw = quantize(w, bits=bits, group_size=group)
    bk = pl.get_backend(backend)
    arrays = [bk.to_numpy(a) for a in qw.arrays]
    return x, x64, qw, arrays


@given(bits=INT8_BITS, group=GROUPS, rows=st.sampled_from([1, 3]), seed=seeds())
def test_portable_int8_equals_the_reference(backend, dtype, bits, group, rows, seed):
    x, x64, qw, (p, s, b) = _case(backend, dtype, bits, group, rows, seed)
    got = qlinear(x, qw, activations="int8", impl="portable")
    compute = np.float64 if dtype == "float64" else np.float32
    want = reference.quantized_linear_int8(
        x64, p, s, b, bits=bits, group_size=group, compute=compute
    )
    assert_close(got, want, backend=backend, dtype=dtype)


# JAX compiles a program per example (12-21 s a dtype): float32 in the default run, the half
# dtypes in tox -e slow (issue 34)
@pytest.mark.slow_on("jax", dtypes=("bfloat16", "float16"))
@given(bits=INT8_BITS, group=GROUPS, rows=st.sampled_from([1, 5, PREFILL_ROWS]), seed=seeds())
def test_native_int8_equals_portable(backend, dtype, bits, group, rows, seed):
    """numba's kernel (NumPy, torch's CPU): the same integer dots, the blocks summed in another
    order in float32; JAX's, MLX's and a prompt's rows on NumPy and torch: the Q8_0 blocks'
    values times the codes in float32. Within the dtype's tolerance of the portable path.
    numba's specialization for a bound weight (the repack done once) gives the call's bits."""
    if "quantized_linear_int8" not in dispatcher(pl.get_backend(backend)).native:
        pytest.skip(f"{backend} has no native quantized_linear_int8")
    if dtype == "float64":
        pytest.skip("float64 keeps the portable path's float64 arithmetic")
    x, _, qw, _ = _case(backend, dtype, bits, group, rows, seed)
    bias, _ = random_array(seed + 2, (24,), dtype, backend=backend)
    d = dispatcher(pl.get_backend(backend))
    fmt = {"bits": bits, "group_size": group}
    nat = d.native["quantized_linear_int8"]
    if nat.applies is not None and not nat.applies(x, *qw.arrays, bias, **fmt):
        # MLX's kernel takes groups of 32 to 128: auto says so by running the portable path
        with pl.trace() as t:
            qlinear(x, qw, activations="int8")
        assert [(e.op, e.impl) for e in t] == [("quantized_linear_int8", "portable")]
        return
    native = qlinear(x, qw, bias, activations="int8", impl="native")
    assert_close(native, qlinear(x, qw, bias, activations="int8", impl="portable"))
    chosen = d.pick("quantized_linear_int8", "native", x, *qw.arrays, bias, **fmt)
    bound = d.specialized("quantized_linear_int8", chosen, x, *qw.arrays, bias, **fmt)
    if nat.specialize is None:  # JAX's and MLX's: nothing to repack
        assert bound is None
    elif bound is not None:
        assert np.array_equal(pl.to_numpy(bound(d.backend.xp, x, bias)), pl.to_numpy(native))
    else:  # only a prompt's dense route repacks nothing
        assert rows >= PREFILL_ROWS
    with pl.trace() as t:
        qlinear(x, qw, activations="int8")
    assert [(e.op, e.impl) for e in t] == [("quantized_linear_int8", "native")]


@given(bits=INT8_BITS, group=GROUPS, seed=seeds())
def test_int8_differs_from_the_exact_mode_by_at_most_the_activations_rounding(
    backend, bits, group, seed
):
    """Each activation moves by at most half its block's step ``d / 2``, so each output moves
    by at most ``sum_j d_j / 2 * sum_(k in j) |w[n, k]|`` (the dequantized weight), plus the
    float32 rounding of the two products."""
    dtype = "float32"
    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no float32")
    x, x64, qw, (p, s, b) = _case(backend, dtype, bits, group, 2, seed)
    got = pl.to_numpy(qlinear(x, qw, activations="int8")).astype(np.float64)
    exact = pl.to_numpy(qlinear(x, qw)).astype(np.float64)
    w = np.abs(reference.dequantize(p, s, b, bits=bits, group_size=group))  # (N, K)
    a = min(32, group)
    d = np.abs(x64).reshape(2, -1, a).max(axis=-1) / 127  # (M, J)
    wsum = w.reshape(w.shape[0], -1, a).sum(axis=-1)  # (N, J)
    bound = (d / 2) @ wsum.T  # (M, N)
    tol = tolerance(dtype, backend)
    slack = 2 * (tol.atol + tol.rtol * np.abs(exact))
    assert np.all(np.abs(got - exact) <= bound + slack)
    assert np.any(got != exact)  # the mode does round: it is not the exact product


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_native_int8_at_the_largest_dots(backend, bits):
    """The kernel's narrowest accumulator at its limit: every activation code +-127 and every
    code at the end of its range, so each block's dot is ``127 * 32 * (q - c)`` (4 bits:
    -32512 in the int16 accumulator, one step from overflowing). Equal to the portable path."""
    if "quantized_linear_int8" not in dispatcher(pl.get_backend(backend)).native:
        pytest.skip(f"{backend} has no native quantized_linear_int8")
    k, n = 64, 70  # 70 rows: a second, padded tile of 64
    codes = np.zeros((n, k), np.int32)  # the lowest code, q - c = -c
    codes[1::2] = (1 << bits) - 1  # the highest, q - c = c - 1
    packed = pack_codes(np, codes, bits=bits)
    scales = np.linspace(0.01, 0.02, n * 2, dtype=np.float32).reshape(n, 2)
    biases = np.linspace(-0.1, 0.1, n * 2, dtype=np.float32).reshape(n, 2)
    x = np.full((2, k), 0.5, np.float32)
    x[1, ::2] = -0.5  # codes +-127 in every block
    bk = pl.get_backend(backend)
    qw = QuantizedWeight(*(bk.from_numpy(a) for a in (packed, scales, biases)), bits=bits,
                         group_size=32)  # fmt: skip
    xb = bk.from_numpy(x)
    native = qlinear(xb, qw, activations="int8", impl="native")
    assert_close(native, qlinear(xb, qw, activations="int8", impl="portable"))


@given(seed=seeds())
def test_numba_q8_blocks_equal_the_portable_blocks(seed):
    """numba's Q8_0 blocks (scales and codes) are the portable path's, bit for bit, also after
    a kernel that calls them has compiled them (numba compiles a callee with its caller's
    flags: a fastmath kernel made the divisions products by a reciprocal, and the block below
    got the code -96 for -96.50001)."""
    if not numba_cpu.available():
        pytest.skip("numba is not installed")
    qw = quantize(np.ones((64, 32), np.float32), bits=4, group_size=32)
    numba_cpu.run(numba_cpu.prepack(*qw.arrays, bits=4, group_size=32), np.ones((1, 32), "f4"))
    x, _ = random_array(seed, (4, 64), "float32")
    x[0, :16] = [-0.41996148, -1.1893268, 1.8969258, -2.0787868, -2.4849405, -1.3092481,
                 2.4090025, 2.8677454, -0.9801681, 1.0137314, -0.8141215, -1.6835964,
                 -0.8329458, -2.179035, -1.7021639, 1.6332239]  # fmt: skip
    xq, d = quantize_activations(np, x, block=16)  # (M, J, A), (M, J, 1)
    got = numba_cpu.q8_values(x, 16)
    assert np.array_equal(got, (xq * d).reshape(4, 64))


def test_numba_kernels_are_cacheable_across_processes():
    """numba's on-disk cache (``cache=True``) keys a kernel by its code and its closure: the
    kernels once defined inside a function held their callee in a closure cell, so every new
    process compiled them again (5-10 s per test process and CLI run that first used the int8
    mode) and saved one more cache entry. Module-level kernels with no closure load from it."""
    if not numba_cpu.available():
        pytest.skip("numba is not installed")
    from portable_llm.native import numba_kernels

    for kernel in (numba_kernels.quantize, numba_kernels.nibbles, numba_kernels.bytes_):
        assert type(kernel._cache).__name__ == "FunctionCache"  # cache=True
        assert kernel.py_func.__closure__ is None, kernel.py_func.__qualname__
        assert "<locals>" not in kernel.py_func.__qualname__
    assert numba_cpu._kernels()[1] is numba_kernels.bytes_


@pytest.mark.slow_on("jax")  # 14 s of compiles: tox -e slow (issue 34)
@given(bits=INT8_BITS, group=GROUPS, seed=seeds())
def test_jax_integer_dot_equals_portable(backend, bits, group, seed):
    """JAX's int8 x int8 -> int32 ``lax.dot_general`` form (tested, measured slower than XLA's
    float32 dot on a CPU, so not the registered kernel): the portable path's integers, its
    float32 combination in XLA's order."""
    if backend != "jax":
        pytest.skip("JAX's integer-dot kernel")
    from portable_llm.native.jax import quantized_linear_int8_integer

    x, _, qw, _ = _case(backend, "float32", bits, group, 3, seed)
    bias, _ = random_array(seed + 2, (24,), "float32", backend=backend)
    got = quantized_linear_int8_integer(x, *qw.arrays, bias, bits=bits, group_size=group)
    assert_close(got, qlinear(x, qw, bias, activations="int8", impl="portable"))


@pytest.mark.parametrize("kernel", ["quantized_linear", "quantized_linear_int8"])
def test_jax_row_product_reads_x_from_a_buffer(backend, kernel):
    """Regression (issue 30): with one row of x (a decode step) XLA's CPU fusion took x's cheap
    elementwise producers (here a norm's multiply; in the int8 mode also the Q8_0 blocks'
    rounding and scaling) into the product's loop fusion and redid them for every output
    element (1536x576 int8: 10x the exact mode's time; SmolLM2's compiled decode step 0.26x
    the float mode's, whose own norms cost it too). The computation that holds the dot must
    read x's values as they are: no op of x's shapes but parameters and bitcasts."""
    if backend != "jax":
        pytest.skip("JAX's kernels (XLA's fusion)")
    import jax
    import jax.numpy as jnp

    from portable_llm.native import jax as native_jax

    fn = getattr(native_jax, kernel)
    h, _ = random_array(0, (1, 256), "float32", backend=backend)
    g, _ = random_array(1, (256,), "float32", backend=backend)
    w, _ = random_weight(2, (192, 256), "float32", backend=backend)
    qw = quantize(w, bits=4, group_size=32)
    program = jax.jit(lambda h, g, *a: fn(jnp, h * g, *a, None, bits=4, group_size=32))
    hlo = program.lower(h, g, *qw.arrays).compile().as_text()
    computations = re.split(r"\n(?=\S)", hlo)  # one HLO computation per block
    with_dot = [c for c in computations if " dot(" in c]
    assert with_dot
    x_shapes = r"f32\[(?:1,)?256\]|f32\[(?:1,)?8,32\]|f32\[(?:1,)?8(?:,1)?\]"
    ops = [m for c in with_dot for m in re.findall(rf"= (?:{x_shapes})\{{[\d,]*\}} (\S+)\(", c)]
    assert ops and set(ops) <= {"parameter", "bitcast"}, ops
    assert not [c for c in with_dot if "round-nearest-even" in c]


def test_activations_must_be_float_or_int8():
    w, _ = random_weight(0, (8, 32), "float32")
    x, _ = random_array(1, (2, 32), "float32")
    with pytest.raises(ValueError, match=r"activations must be one of \('float', 'int8'\)"):
        qlinear(x, quantize(w, bits=4, group_size=32), activations="int4")


def test_an_all_zero_block_gives_zero_codes():
    """A block of zeros has scale 0 and codes 0 (no division by zero): its products are 0."""
    w, _ = random_weight(0, (8, 64), "float32")
    qw = quantize(w, bits=4, group_size=32)
    x = np.zeros((1, 64), np.float32)
    x[0, 40] = 3.0  # only the second block is not zero
    got = qlinear(x, qw, activations="int8", impl="portable")
    want = reference.quantized_linear_int8(x, *(np.asarray(a) for a in qw.arrays), bits=4,
                                           group_size=32)  # fmt: skip
    assert np.all(np.isfinite(got))
    assert_close(got, want, backend="numpy", dtype="float32")
