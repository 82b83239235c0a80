"""Bad input: a ValueError/TypeError naming the op, the argument and the shapes, on every backend.

Each case runs on every backend so the error is ours, raised before any backend kernel runs.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close


def arr(backend, shape, dtype="float32"):
    return pl.asarray(np.ones(shape), backend=backend, dtype=dtype)


def test_rms_norm_weight_length(backend):
    with pytest.raises(ValueError, match=re.escape("rms_norm: weight must have shape (16,)")) as e:
        pl.rms_norm(arr(backend, (2, 16)), arr(backend, (8,)))
    assert "(2, 16)" in str(e.value) and "(8,)" in str(e.value)


def test_rms_norm_weight_not_1d(backend):
    with pytest.raises(ValueError, match=re.escape("got (1, 16)")):
        pl.rms_norm(arr(backend, (2, 16)), arr(backend, (1, 16)))


@pytest.mark.parametrize("bad", ["int32", "int64", "bool"])
def test_rms_norm_rejects_integer_and_bool_input(backend, bad):
    with pytest.raises(TypeError, match=f"rms_norm: x must have a float dtype .*got {bad}"):
        pl.rms_norm(arr(backend, (2, 4), bad), arr(backend, (4,)))
    with pytest.raises(TypeError, match=f"rms_norm: weight must have a float dtype .*got {bad}"):
        pl.rms_norm(arr(backend, (2, 4)), arr(backend, (4,), bad))


@pytest.mark.parametrize("eps", [-1e-6, float("nan")])
def test_rms_norm_eps_negative(backend, eps):
    with pytest.raises(ValueError, match="rms_norm: eps must be >= 0"):
        pl.rms_norm(arr(backend, (2, 4)), arr(backend, (4,)), eps=eps)


def test_rms_norm_scalar_input(backend):
    with pytest.raises(ValueError, match=re.escape("rms_norm: x must have at least 1 dimension")):
        pl.rms_norm(arr(backend, ()), arr(backend, (1,)))


@pytest.mark.parametrize("op", ["silu", "gelu", "gelu_tanh", "relu", "softmax"])
def test_unary_ops_reject_integers(backend, op):
    with pytest.raises(TypeError, match=f"{op}: x must have a float dtype .*got int32 with shape"):
        getattr(pl, op)(arr(backend, (3,), "int32"))


@pytest.mark.parametrize("eps", ["1e-6", None, [1e-6]])
def test_rms_norm_eps_not_a_number(backend, eps):
    with pytest.raises(
        TypeError, match=re.escape(f"rms_norm: eps must be a real number >= 0, got {eps!r}")
    ):
        pl.rms_norm(arr(backend, (2, 4)), arr(backend, (4,)), eps=eps)


@pytest.mark.parametrize("axis", [True, 1.0, "1", None])
def test_softmax_axis_not_an_int(backend, axis):
    got = f"got {type(axis).__name__} {axis!r}"
    with pytest.raises(TypeError, match=re.escape(f"softmax: axis must be an int, {got}")):
        pl.softmax(arr(backend, (2, 3)), axis=axis)


def test_softmax_axis_accepts_numpy_ints(backend):
    x = arr(backend, (2, 3))
    assert_close(pl.softmax(x, axis=np.int64(0)), pl.softmax(x, axis=0))


def test_softmax_axis_out_of_range(backend):
    with pytest.raises(
        ValueError, match=re.escape("softmax: axis=2 is out of range for x of shape (2, 3)")
    ):
        pl.softmax(arr(backend, (2, 3)), axis=2)


def test_linear_mismatched_dims(backend):
    with pytest.raises(ValueError, match=re.escape("linear: weight must have shape (O, 8)")) as e:
        pl.linear(arr(backend, (2, 8)), arr(backend, (4, 6)))
    assert "(2, 8)" in str(e.value) and "(4, 6)" in str(e.value)


def test_linear_bias_shape(backend):
    with pytest.raises(
        ValueError, match=re.escape("linear: the bias of weight must have shape (4,)")
    ):
        pl.linear(arr(backend, (2, 8)), arr(backend, (4, 8)), arr(backend, (8,)))


def test_linear_weight_dtype(backend):
    """A float weight of another dtype is cast to x's (docs/mixed-precision.md); an int one is
    a TypeError."""
    if "float64" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no float64")
    x, w = arr(backend, (2, 8)), arr(backend, (4, 8), "float64")
    out = pl.linear(x, w)
    assert out.dtype == x.dtype
    assert_close(out, pl.linear(x, pl.get_backend(backend).astype(w, x.dtype)), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"linear: weight must have a float dtype .*got int32"):
        pl.linear(x, arr(backend, (4, 8), "int32"))


def test_mlp_shapes(backend):
    x, wg = arr(backend, (2, 3, 8)), arr(backend, (16, 8))
    with pytest.raises(ValueError, match=re.escape("mlp: w_down must have shape (8, 16)")):
        pl.mlp(x, wg, wg, arr(backend, (16, 8)))
    with pytest.raises(ValueError, match=re.escape("mlp: w_up must have the shape of w_gate")):
        pl.mlp(x, wg, arr(backend, (12, 8)), arr(backend, (8, 16)))
    with pytest.raises(ValueError, match=re.escape("mlp: w_gate must have shape (O, 8)")):
        pl.mlp(x, arr(backend, (16, 4)), wg, arr(backend, (8, 16)))
    with pytest.raises(ValueError, match=re.escape("mlp: b_down must have shape (8,), got (16,)")):
        pl.mlp(x, wg, wg, arr(backend, (8, 16)), b_down=arr(backend, (16,)))


def test_mlp_unknown_activation_lists_known(backend):
    x, wg, wd = arr(backend, (2, 8)), arr(backend, (16, 8)), arr(backend, (8, 16))
    with pytest.raises(ValueError, match=r"mlp: unknown activation 'swiglu'; known: gelu, .*silu"):
        pl.mlp(x, wg, wg, wd, act="swiglu")


@pytest.mark.parametrize(
    ("args", "kwargs", "msg"),
    [
        ((0,), {}, "hidden_size must be a positive int"),
        ((4096.0,), {}, "hidden_size must be a positive int"),
        ((4096,), {"multiple_of": 0}, "multiple_of must be a positive int"),
        ((4096,), {"ratio": -1.0}, "ratio must be a positive number"),
        ((4096,), {"ratio": float("inf")}, "ratio must be a positive number"),
    ],
)
def test_intermediate_size_rejects_bad_values(args, kwargs, msg):
    with pytest.raises(ValueError, match=f"intermediate_size: {msg}"):
        pl.intermediate_size(*args, **kwargs)


def test_sdpa_accepts_numpy_scalar_options(backend):
    """window, softcap, scale and block_size as NumPy scalars mean their Python values."""
    q = pl.asarray(np.linspace(-1, 1, 2 * 4 * 8).reshape(1, 2, 4, 8), backend=backend,
                   dtype="float32")  # fmt: skip
    kw = {"window": 2, "softcap": 5.0, "scale": 0.5, "block_size": 2}
    np_kw = {"window": np.int64(2), "softcap": np.float32(5.0), "scale": np.float32(0.5),
             "block_size": np.int32(2)}  # fmt: skip
    for impl in ("auto", "portable", "tiled"):
        want = pl.scaled_dot_product_attention(q, q, q, impl=impl, **kw)
        assert_close(pl.scaled_dot_product_attention(q, q, q, impl=impl, **np_kw), want)


_NOT_NUMBERS = [
    ("window", np.float32(2.0)),
    ("softcap", "5"),
    ("scale", True),
    ("block_size", np.float64(2)),
]


@pytest.mark.parametrize(("option", "value"), _NOT_NUMBERS)
def test_sdpa_rejects_non_numbers(backend, option, value):
    q = pl.asarray(np.ones((1, 1, 2, 4)), backend=backend, dtype="float32")
    with pytest.raises(ValueError, match=f"scaled_dot_product_attention: {option} must be"):
        pl.scaled_dot_product_attention(q, q, q, **{option: value})
