"""silu, gelu, gelu_tanh, relu, softmax, rms_norm, linear, mlp: values, shapes, dtypes, properties.

Every case runs on each backend and each float dtype it supports, against the independent
float64 NumPy formulas in ``portable_llm.testing.reference``, on the same (rounded) inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.testing import assert_close, random_array, random_weight, reference, tolerance
from portable_llm.testing.strategies import seeds, shapes, sizes

ACTS = ["silu", "gelu", "gelu_tanh", "relu"]


@pytest.mark.parametrize("op", ACTS)
@given(shape=shapes(max_last=48), seed=seeds())
def test_activation_matches_reference(backend, dtype, op, shape, seed):
    x, xr = random_array(seed, shape, dtype, backend=backend, low=-6, high=6)
    out = getattr(pl, op)(x)
    assert_close(out, getattr(reference, op)(xr), backend=backend, dtype=dtype)


@given(shape=shapes(max_last=48), seed=seeds(), axis=st.integers(-2, -1))
def test_softmax_matches_reference(backend, dtype, shape, seed, axis):
    if len(shape) < -axis:
        shape = (2, *shape)
    x, xr = random_array(seed, shape, dtype, backend=backend, low=-8, high=8)
    assert_close(
        pl.softmax(x, axis=axis), reference.softmax(xr, axis), backend=backend, dtype=dtype
    )


@given(shape=shapes(max_last=64), seed=seeds(), eps=st.sampled_from([0.0, 1e-6, 1e-5]))
def test_rms_norm_matches_reference(backend, dtype, shape, seed, eps):
    x, xr = random_array(seed, shape, dtype, backend=backend)
    w, wr = random_array(seed + 1, shape[-1:], dtype, backend=backend, low=0.5, high=1.5)
    assert_close(
        pl.rms_norm(x, w, eps=eps), reference.rms_norm(xr, wr, eps), backend=backend, dtype=dtype
    )


@given(shape=shapes(max_last=32), out=sizes(24), seed=seeds(), bias=st.booleans())
def test_linear_matches_reference(backend, dtype, shape, out, seed, bias):
    fan_in = shape[-1]
    x, xr = random_array(seed, shape, dtype, backend=backend)
    w, wr = random_weight(seed + 1, (out, fan_in), dtype, backend=backend)
    b, br = random_array(seed + 2, (out,), dtype, backend=backend) if bias else (None, None)
    assert_close(pl.linear(x, w, b), reference.linear(xr, wr, br), backend=backend, dtype=dtype)


@pytest.mark.parametrize("act", ACTS)
@given(
    lead=st.lists(st.sampled_from([1, 3]), min_size=1, max_size=2),
    e=sizes(33),
    i=sizes(64),
    seed=seeds(),
)
def test_mlp_matches_reference(backend, dtype, act, lead, e, i, seed):
    x, xr = random_array(seed, (*lead, e), dtype, backend=backend)
    wg, wgr = random_weight(seed + 1, (i, e), dtype, backend=backend)
    wu, wur = random_weight(seed + 2, (i, e), dtype, backend=backend)
    wd, wdr = random_weight(seed + 3, (e, i), dtype, backend=backend)
    out = pl.mlp(x, wg, wu, wd, act=act)
    assert_close(out, reference.mlp(xr, wgr, wur, wdr, act), backend=backend, dtype=dtype)


def test_mlp_biases_match_reference(backend, dtype):
    e, i = 16, 24
    x, xr = random_array(0, (2, 3, e), dtype, backend=backend)
    wg, wgr = random_weight(1, (i, e), dtype, backend=backend)
    wu, wur = random_weight(2, (i, e), dtype, backend=backend)
    wd, wdr = random_weight(3, (e, i), dtype, backend=backend)
    bg, bgr = random_array(4, (i,), dtype, backend=backend)
    bu, bur = random_array(5, (i,), dtype, backend=backend)
    bd, bdr = random_array(6, (e,), dtype, backend=backend)
    out = pl.mlp(x, wg, wu, wd, b_gate=bg, b_up=bu, b_down=bd)
    h = reference.silu(reference.linear(xr, wgr, bgr)) * reference.linear(xr, wur, bur)
    assert_close(out, reference.linear(h, wdr, bdr), backend=backend, dtype=dtype)


# -- properties ------------------------------------------------------------------------------


@given(shape=shapes(max_last=64), seed=seeds(), k=st.integers(-6, 6))
def test_rms_norm_is_scale_invariant(backend, dtype, shape, seed, k):
    # Scaling by a power of two is exact in every float dtype, so only the op's own rounding
    # separates rms_norm(c x) from rms_norm(x) (eps = 0 makes the invariance exact in math).
    x, _ = random_array(seed, shape, dtype, backend=backend)
    cx, _ = random_array(seed, shape, dtype, backend=backend, scale=2.0**k)  # exactly 2^k x
    w, _ = random_array(seed + 1, shape[-1:], dtype, backend=backend)
    assert_close(pl.rms_norm(cx, w, eps=0.0), pl.rms_norm(x, w, eps=0.0))


@given(shape=shapes(max_last=64), seed=seeds())
def test_softmax_rows_sum_to_one(backend, dtype, shape, seed):
    x, _ = random_array(seed, shape, dtype, backend=backend, low=-20, high=20)
    total = np.sum(pl.to_numpy(pl.softmax(x)).astype(np.float64), axis=-1)
    tol = tolerance(dtype)
    # Each of D outputs is rounded once to the dtype (relative error <= u) and all are <= 1.
    assert np.all(np.abs(total - 1.0) <= tol.atol + tol.rtol), total


@given(shape=shapes(max_last=64), seed=seeds(), c=st.integers(-16, 16))
def test_softmax_is_shift_invariant(backend, shape, seed, c):
    # float32 only: x + c is then exact to ~2^-20, far inside the tolerance, while in half
    # precision the rounding of x + c would itself move the inputs by more than the tolerance.
    x, _ = random_array(seed, shape, "float32", backend=backend)
    assert_close(pl.softmax(x + float(c)), pl.softmax(x))


def test_mlp_with_zero_up_projection_is_zero(backend, dtype):
    x, _ = random_array(0, (2, 5, 8), dtype, backend=backend)
    wg, _ = random_array(1, (12, 8), dtype, backend=backend)
    wd, _ = random_array(2, (8, 12), dtype, backend=backend)
    wu = pl.asarray(np.zeros((12, 8)), backend=backend, dtype=dtype)
    out = pl.to_numpy(pl.mlp(x, wg, wu, wd)).astype(np.float64)
    assert np.array_equal(out, np.zeros((2, 5, 8)))


def test_silu_limits(backend, dtype):
    tol = tolerance(dtype, backend)
    x = pl.asarray([20.0, 50.0, 100.0, 1000.0], backend=backend, dtype=dtype)
    t = pl.to_numpy(x).astype(np.float64)
    out = pl.to_numpy(pl.silu(x)).astype(np.float64)
    # silu(t) = t - t / (1 + e^t): within t e^-t (< 5e-8 for t >= 20) of t, plus rounding.
    assert np.all(np.abs(out - t) <= t * np.exp(-t) + tol.atol + tol.rtol * t), out
    neg = pl.asarray([-20.0, -50.0, -1000.0, -1e4], backend=backend, dtype=dtype)
    out = pl.to_numpy(pl.silu(neg)).astype(np.float64)
    assert np.all(np.isfinite(out))
    # |silu(-t)| = t / (1 + e^t) <= 20 e^-20 = 4.1e-8 for t >= 20: zero up to rounding.
    assert np.all(np.abs(out) <= 20 * np.exp(-20.0) + tol.atol), out


def test_silu_float16_minus_1e4_is_not_nan(backend):
    if "float16" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no float16")
    out = pl.to_numpy(pl.silu(pl.asarray([-1e4, -6e4, 6e4], backend=backend, dtype="float16")))
    assert out.dtype == np.float16
    assert out[0] == 0.0 and out[1] == 0.0 and out[2] == np.float16(6e4)


@pytest.mark.parametrize("impl", ["auto", "portable"])
def test_rms_norm_float16_accumulates_in_float32(backend, impl):
    """Values near 300: every square (~9e4) overflows float16 (max 65504), the result does not.

    A mean of squares taken in float16 gives inf, then zeros; float32 accumulation, as the
    contract says, gives the reference values.
    """
    if "float16" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no float16")
    x, xr = random_array(3, (2, 64), "float16", backend=backend, low=250, high=350)
    w, wr = random_array(4, (64,), "float16", backend=backend, low=0.5, high=1.5)
    out = pl.rms_norm(x, w, eps=1e-6, impl=impl)
    assert_close(out, reference.rms_norm(xr, wr, 1e-6), backend=backend, dtype="float16")


@pytest.mark.parametrize("impl", ["auto", "portable"])
def test_softmax_float16_accumulates_in_float32(backend, impl):
    """70000 near-equal logits: their exponentials sum past float16's max (65504).

    A float16 sum overflows to inf and every probability rounds to 0; with the float32 sum each
    is about 1/70000 (1.4e-5, a float16 subnormal), as the float64 reference says.
    """
    if "float16" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no float16")
    x, xr = random_array(5, (1, 70000), "float16", backend=backend, low=-0.01, high=0.01)
    out = pl.softmax(x, impl=impl)
    assert_close(out, reference.softmax(xr, -1), backend=backend, dtype="float16")
    assert np.all(pl.to_numpy(out) > 0)


def test_relu_propagates_nan(backend):
    x = pl.asarray([float("nan"), -1.0, 2.0], backend=backend, dtype="float32")
    out = pl.to_numpy(pl.relu(x))
    assert np.isnan(out[0]) and out[1] == 0.0 and out[2] == 2.0


# -- cross-backend agreement -----------------------------------------------------------------


@pytest.mark.parametrize("op", [*ACTS, "softmax"])
def test_unary_ops_agree_with_numpy(other_backend, op):
    x_np, _ = random_array(7, (3, 5, 33), "float32")
    out = getattr(pl, op)(pl.asarray(x_np, backend=other_backend))
    assert_close(out, getattr(pl, op)(x_np), backend=other_backend, dtype="float32")


def test_rms_norm_linear_mlp_agree_with_numpy(other_backend):
    x, _ = random_array(3, (2, 4, 32), "float32")
    w, _ = random_array(4, (32,), "float32")
    wg, _ = random_weight(5, (48, 32), "float32")
    wd, _ = random_weight(6, (32, 48), "float32")
    b = other_backend
    assert_close(pl.rms_norm(x, w, backend=b), pl.rms_norm(x, w), backend=b)
    assert_close(pl.linear(x, wg, backend=b), pl.linear(x, wg), backend=b)
    assert_close(pl.mlp(x, wg, wg, wd, backend=b), pl.mlp(x, wg, wg, wd), backend=b)


def test_intermediate_size_llama_rule():
    # Published Llama 1 widths: 7B, 13B, 33B (multiple_of=256) and 65B.
    assert pl.intermediate_size(4096) == 11008
    assert pl.intermediate_size(5120) == 13824
    assert pl.intermediate_size(6656) == 17920
    assert pl.intermediate_size(8192) == 22016
    assert pl.intermediate_size(768, ratio=4.0, multiple_of=1) == 3072


@given(e=st.integers(1, 10_000), m=st.integers(1, 512))
def test_intermediate_size_is_smallest_multiple_covering_ratio(e, m):
    n = pl.intermediate_size(e, multiple_of=m)
    floor = (8 * e) // 3
    assert n % m == 0 and n >= floor and n - m < floor


# -- special values: +-inf through every impl -------------------------------------------------


def _impls(backend: str, op: str) -> list[str]:
    from portable_llm.core.dispatch import dispatcher

    has_native = op in dispatcher(pl.get_backend(backend)).native
    return ["auto", "portable", *(["native"] if has_native else [])]


@pytest.mark.parametrize("op", ["gelu", "gelu_tanh", "silu"])
def test_activation_of_plus_and_minus_inf(backend, dtype, op):
    """+inf -> inf and -inf -> NaN (docs/ops/activations.md's table) under every impl: torch's
    F.gelu gives NaN for +inf in float32 and bfloat16, which its kernel now puts right."""
    x = pl.asarray([np.inf, -np.inf, 1.0], backend=backend, dtype=dtype)
    for impl in _impls(backend, op):
        with np.errstate(invalid="ignore"):  # NumPy warns on -inf * 0, as documented
            out = pl.to_numpy(getattr(pl, op)(x, impl=impl)).astype(np.float64)
        assert out[0] == np.inf, (impl, out)
        assert np.isnan(out[1]), (impl, out)


# -- zero-size dimensions: the correctly shaped result on every backend -------------------------


def _zeros(backend: str, shape: tuple[int, ...]) -> object:
    return pl.asarray(np.ones(shape, np.float32), backend=backend)


@pytest.mark.parametrize("shape", [(2, 0), (0, 3), (0, 0)])
@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("impl", ["auto", "portable"])
def test_softmax_of_zero_size_input(backend, shape, axis, impl):
    out = pl.softmax(_zeros(backend, shape), axis=axis, impl=impl)
    assert tuple(out.shape) == shape and pl.to_numpy(out).dtype == np.float32


@pytest.mark.parametrize("impl", ["auto", "portable"])
def test_zero_size_features(backend, impl):
    """D = 0 (and K = 0, I = 0): shaped results; a projection over nothing is its bias."""
    a = lambda *s: _zeros(backend, s)  # noqa: E731
    assert tuple(pl.rms_norm(a(2, 0), a(0), impl=impl).shape) == (2, 0)
    assert tuple(pl.rms_norm(a(0, 4), a(4), impl=impl).shape) == (0, 4)
    for op in ACTS:
        assert tuple(getattr(pl, op)(a(2, 0), impl=impl).shape) == (2, 0)
    y = pl.to_numpy(pl.linear(a(2, 0), a(3, 0), impl=impl))
    assert y.shape == (2, 3) and np.array_equal(y, np.zeros((2, 3)))
    b = pl.asarray(np.array([1.0, -2.0, 3.0], np.float32), backend=backend)
    y = pl.to_numpy(pl.linear(a(2, 0), a(3, 0), b, impl=impl))
    assert np.array_equal(y, np.tile([1.0, -2.0, 3.0], (2, 1)))
    assert tuple(pl.linear(a(2, 4), a(0, 4), impl=impl).shape) == (2, 0)
    assert tuple(pl.mlp(a(2, 0), a(3, 0), a(3, 0), a(0, 3), impl=impl).shape) == (2, 0)
    y = pl.to_numpy(pl.mlp(a(2, 4), a(0, 4), a(0, 4), a(4, 0), impl=impl))  # I = 0
    assert np.array_equal(y, np.zeros((2, 4)))
    y = pl.to_numpy(pl.unembed(a(2, 0), a(5, 0), impl=impl))
    assert np.array_equal(y, np.zeros((2, 5)))
    moe = pl.moe(a(2, 0), a(3, 0), a(3, 2, 0), a(3, 2, 0), a(3, 0, 2), top_k=1,
                 norm_topk_prob=True, impl=impl)  # fmt: skip
    assert tuple(moe.shape) == (2, 0)


# -- scalar arguments: NumPy integers accepted, bools and floats refused ----------------------


def test_numpy_integer_arguments_equal_python_ints(backend):
    x, _ = random_array(0, (3, 6), "float32", backend=backend)
    assert_close(pl.softmax(x, axis=np.int64(-1)), pl.to_numpy(pl.softmax(x, axis=-1)), rtol=0,
                 atol=0, backend=backend)  # fmt: skip
    w, _ = random_array(1, (4, 6), "float32", backend=backend)
    for got, want in zip(
        pl.route(x, w, top_k=np.int64(2), norm_topk_prob=True),
        pl.route(x, w, top_k=2, norm_topk_prob=True),
        strict=True,
    ):
        np.testing.assert_array_equal(pl.to_numpy(got), pl.to_numpy(want))
    key = 7 if backend != "jax" else None
    if backend == "jax":
        import jax

        key = jax.random.key(7)
    opts = {"temperature": np.float32(0.75), "top_p": np.float64(0.9), "min_p": np.float32(0.125)}
    got = pl.sample(x, top_k=np.int64(3), key=key, **opts)
    want = pl.sample(x, top_k=3, key=key, temperature=0.75, top_p=0.9, min_p=0.125)
    np.testing.assert_array_equal(pl.to_numpy(got), pl.to_numpy(want))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda x, w: pl.softmax(x, axis=True), "softmax: axis must be an int, got bool"),
        (lambda x, w: pl.route(x, w, top_k=2.0, norm_topk_prob=True),
         "route: top_k must be an int, got float"),
        (lambda x, w: pl.moe(x, w, None, None, None, top_k=True, norm_topk_prob=True),
         "moe: top_k must be an int, got bool"),
        (lambda x, w: pl.sample(x, top_k=True, key=0), "sample: top_k must be an int, got bool"),
        (lambda x, w: pl.sample(x, top_k=3.0, key=0), "sample: top_k must be an int, got float"),
        (lambda x, w: pl.sample(x, temperature=True, key=0),
         "sample: temperature must be a real number, got bool"),
        (lambda x, w: pl.logprobs(x, top_p="0.9"),
         "logprobs: top_p must be a real number, got str"),
        (lambda x, w: pl.rms_norm(x, w[0], eps=True), "rms_norm: eps must be a real number"),
    ],
)  # fmt: skip
def test_bool_and_float_arguments_are_type_errors(call, match):
    x, _ = random_array(0, (3, 6), "float32")
    w, _ = random_array(1, (4, 6), "float32")
    with pytest.raises(TypeError, match=match):
        call(x, w)
