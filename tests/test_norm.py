"""layer_norm, and rms_norm's Gemma scale (``offset``) and weightless form: values, properties,
native kernels against the portable path, errors.

Values are checked against the float64 NumPy formulas of ``portable_llm.testing.reference`` on
the same (rounded) inputs; the plain ``rms_norm`` has its tests in test_ops.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.core.dispatch import dispatcher
from portable_llm.testing import assert_close, random_array, reference
from portable_llm.testing.strategies import seeds, shapes


def _impls(backend: str, op: str) -> list[str]:
    has_native = op in dispatcher(pl.get_backend(backend)).native
    return ["auto", "portable", *(["native"] if has_native else [])]


def _spread(seed: int, shape: tuple[int, ...], dtype: str, backend: str) -> tuple:
    """x and its float64 copy, each row holding -2 and 2 (D >= 2): a row whose values nearly
    agree would make the float32 mean's rounding, not the op, the error (|mean| / std large)."""
    _, xr = random_array(seed, shape, dtype, backend="numpy")
    if shape[-1] >= 2:
        xr[..., 0], xr[..., -1] = -2.0, 2.0
    return pl.asarray(xr, backend=backend, dtype=dtype), xr


def _affine(seed: int, d: int, dtype: str, backend: str, weight: bool, bias: bool) -> tuple:
    w, wr = random_array(seed, (d,), dtype, backend=backend, low=0.5, high=1.5)
    b, br = random_array(seed + 1, (d,), dtype, backend=backend, low=-0.5, high=0.5)
    return (w, wr) if weight else (None, None), (b, br) if bias else (None, None)


# -- values against the float64 reference ------------------------------------------------------


@given(
    shape=shapes(max_last=64),
    seed=seeds(),
    eps=st.sampled_from([0.0, 1e-6, 1e-5]),
    weight=st.booleans(),
    bias=st.booleans(),
)
def test_layer_norm_matches_reference(backend, dtype, shape, seed, eps, weight, bias):
    x, xr = _spread(seed, shape, dtype, backend)
    (w, wr), (b, br) = _affine(seed + 1, shape[-1], dtype, backend, weight, bias)
    if shape[-1] == 1 and eps == 0.0:
        eps = 1e-5  # one feature has zero variance: 0/0 without eps
    out = pl.layer_norm(x, w, b, eps=eps)
    assert_close(out, reference.layer_norm(xr, wr, br, eps), backend=backend, dtype=dtype)


@given(shape=shapes(max_last=64), seed=seeds(), eps=st.sampled_from([1e-6, 1e-5]))
def test_rms_norm_offset_matches_reference(backend, dtype, shape, seed, eps):
    x, xr = random_array(seed, shape, dtype, backend=backend)
    w, wr = random_array(seed + 1, shape[-1:], dtype, backend=backend, low=-0.5, high=0.5)
    out = pl.rms_norm(x, w, eps=eps, offset=1.0)
    assert_close(out, reference.rms_norm(xr, wr, eps, 1.0), backend=backend, dtype=dtype)


@given(shape=shapes(max_last=64), seed=seeds())
def test_weightless_rms_norm_matches_reference(backend, dtype, shape, seed):
    x, xr = random_array(seed, shape, dtype, backend=backend)
    assert_close(pl.rms_norm(x, eps=1e-6), reference.rms_norm(xr, None, 1e-6), dtype=dtype,
                 backend=backend)  # fmt: skip


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm_offset", "rms_norm_weightless"])
def test_every_impl_matches_the_portable_path(backend, dtype, op):
    """Native kernels (under auto and forced) against the portable path and the reference."""
    x, xr = random_array(3, (2, 7, 96), dtype, backend=backend, low=-2.0, high=4.0)
    w, wr = random_array(4, (96,), dtype, backend=backend, low=-0.5, high=1.5)
    b, br = random_array(5, (96,), dtype, backend=backend, low=-0.5, high=0.5)
    if op == "layer_norm":
        call = lambda impl: pl.layer_norm(x, w, b, impl=impl)  # noqa: E731
        want = reference.layer_norm(xr, wr, br)
    elif op == "rms_norm_offset":
        call = lambda impl: pl.rms_norm(x, w, offset=1.0, impl=impl)  # noqa: E731
        want = reference.rms_norm(xr, wr, 1e-5, 1.0)
    else:
        call = lambda impl: pl.rms_norm(x, impl=impl)  # noqa: E731
        want = reference.rms_norm(xr)
    portable_out = call("portable")
    dispatch_op = "rms_norm" if op == "rms_norm_weightless" else op
    for impl in _impls(backend, dispatch_op):
        out = call(impl)
        assert_close(out, want, backend=backend, dtype=dtype, err_msg=impl)
        assert_close(out, pl.to_numpy(portable_out), backend=backend, dtype=dtype, err_msg=impl)


def test_layer_norm_float16_accumulates_in_float32(backend):
    """Values near 300 over 64 features: the sum of squares (~6e6) overflows float16."""
    if "float16" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no float16")
    x, xr = random_array(0, (3, 64), "float16", backend=backend, low=280.0, high=320.0)
    w, wr = random_array(1, (64,), "float16", backend=backend, low=0.5, high=1.5)
    for impl in _impls(backend, "layer_norm"):
        out = pl.layer_norm(x, w, impl=impl)
        assert_close(out, reference.layer_norm(xr, wr), backend=backend, dtype="float16",
                     err_msg=impl)  # fmt: skip


# -- properties --------------------------------------------------------------------------------


@given(shape=shapes(max_last=64), seed=seeds(), k=st.integers(-6, 6), c=st.integers(-4, 4))
def test_layer_norm_is_shift_and_scale_invariant(backend, shape, seed, k, c):
    # float32: 2^k (x + c) is exact up to the rounding of x + c (~2^-21 at these sizes), far
    # inside the tolerance; eps = 0 makes the invariance exact in math.
    if shape[-1] == 1:
        shape = (*shape[:-1], 2)
    x, _ = _spread(seed, shape, "float32", backend)
    (w, _), (b, _) = _affine(seed + 1, shape[-1], "float32", backend, True, True)
    moved = (x + float(c)) * 2.0**k
    assert_close(pl.layer_norm(moved, w, b, eps=0.0), pl.layer_norm(x, w, b, eps=0.0))


@given(shape=shapes(max_last=64), seed=seeds(), k=st.integers(-6, 6))
def test_rms_norm_offset_is_scale_invariant(backend, dtype, shape, seed, k):
    x, _ = random_array(seed, shape, dtype, backend=backend)
    cx, _ = random_array(seed, shape, dtype, backend=backend, scale=2.0**k)  # exactly 2^k x
    w, _ = random_array(seed + 1, shape[-1:], dtype, backend=backend, low=-0.5, high=0.5)
    assert_close(pl.rms_norm(cx, w, eps=0.0, offset=1.0), pl.rms_norm(x, w, eps=0.0, offset=1.0))


def test_layer_norm_output_has_zero_mean_and_unit_variance(backend):
    x, _ = random_array(7, (4, 5, 33), "float32", backend=backend, low=-3.0, high=9.0)
    y = pl.to_numpy(pl.layer_norm(x, eps=0.0)).astype(np.float64)
    np.testing.assert_allclose(y.mean(axis=-1), 0.0, atol=1e-6)
    np.testing.assert_allclose(y.var(axis=-1), 1.0, rtol=1e-5)


def test_rms_norm_offset_zero_and_weight_none_are_the_plain_norm(backend, dtype):
    x, _ = random_array(8, (3, 40), dtype, backend=backend)
    w, _ = random_array(9, (40,), dtype, backend=backend)
    plain = pl.to_numpy(pl.rms_norm(x, w))
    np.testing.assert_array_equal(pl.to_numpy(pl.rms_norm(x, w, offset=0)), plain)
    ones = pl.asarray(np.ones(40, np.float32), backend=backend, dtype=dtype)
    assert_close(pl.rms_norm(x), pl.to_numpy(pl.rms_norm(x, ones)), backend=backend, dtype=dtype)


def test_layer_norm_agrees_with_numpy(other_backend):
    x, _ = random_array(3, (2, 4, 32), "float32")
    w, _ = random_array(4, (32,), "float32")
    b, _ = random_array(5, (32,), "float32")
    o = other_backend
    assert_close(pl.layer_norm(x, w, b, backend=o), pl.layer_norm(x, w, b), backend=o)
    assert_close(pl.layer_norm(x, None, b, backend=o), pl.layer_norm(x, None, b), backend=o)
    assert_close(pl.rms_norm(x, w, offset=1.0, backend=o), pl.rms_norm(x, w, offset=1.0),
                 backend=o)  # fmt: skip
    assert_close(pl.rms_norm(x, backend=o), pl.rms_norm(x), backend=o)


def test_mixed_precision_weights_take_x_dtype(backend):
    if "bfloat16" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no bfloat16")
    x, _ = random_array(0, (2, 16), "bfloat16", backend=backend)
    w, _ = random_array(1, (16,), "float32", backend=backend)
    b, _ = random_array(2, (16,), "float32", backend=backend)
    w16 = pl.asarray(pl.to_numpy(w), backend=backend, dtype="bfloat16")
    b16 = pl.asarray(pl.to_numpy(b), backend=backend, dtype="bfloat16")
    got = pl.layer_norm(x, w, b)
    assert pl.get_backend(backend).dtype_name(got.dtype) == "bfloat16"
    np.testing.assert_array_equal(pl.to_numpy(got), pl.to_numpy(pl.layer_norm(x, w16, b16)))


@pytest.mark.parametrize("impl", ["auto", "portable"])
def test_zero_features(backend, impl):
    a = pl.asarray(np.ones((2, 0), np.float32), backend=backend)
    e = pl.asarray(np.ones((0,), np.float32), backend=backend)
    assert tuple(pl.layer_norm(a, e, e, impl=impl).shape) == (2, 0)
    assert tuple(pl.layer_norm(a, impl=impl).shape) == (2, 0)
    assert tuple(pl.rms_norm(a, impl=impl).shape) == (2, 0)
    assert tuple(pl.rms_norm(a, e, offset=1.0, impl=impl).shape) == (2, 0)


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda x, w: pl.layer_norm(x, w[:3]), ValueError,
         r"layer_norm: weight must have shape \(6,\) to match the last dimension of x "
         r"\(shape \(3, 6\)\), got \(3,\)"),
        (lambda x, w: pl.layer_norm(x, None, w[None]), ValueError,
         r"layer_norm: bias must have shape \(6,\) .* got \(1, 6\)"),
        (lambda x, w: pl.layer_norm(x, w, eps=-1.0), ValueError, "layer_norm: eps must be >= 0"),
        (lambda x, w: pl.layer_norm(x, w, eps=float("nan")), ValueError,
         "layer_norm: eps must be >= 0"),
        (lambda x, w: pl.layer_norm(x, w, eps=True), TypeError,
         "layer_norm: eps must be a real number"),
        (lambda x, w: pl.layer_norm(x[0, 0]), ValueError,
         r"layer_norm: x must have at least 1 dimension\(s\)"),
        (lambda x, w: pl.layer_norm(x.astype(np.int32), w), TypeError,
         "layer_norm: x must have a float dtype"),
        (lambda x, w: pl.layer_norm(x, w.astype(np.int64)), TypeError,
         "layer_norm: weight must have a float dtype"),
        (lambda x, w: pl.rms_norm(x, offset=1.0), ValueError,
         r"rms_norm: offset=1.0 needs a weight"),
        (lambda x, w: pl.rms_norm(x, w, offset="1"), TypeError,
         "rms_norm: offset must be a real number"),
        (lambda x, w: pl.rms_norm(x, w, offset=float("inf")), ValueError,
         "rms_norm: offset must be finite"),
    ],
)  # fmt: skip
def test_bad_arguments(call, error, match):
    x, _ = random_array(0, (3, 6), "float32")
    w, _ = random_array(1, (6,), "float32")
    with pytest.raises(error, match=match):
        call(x, w)
