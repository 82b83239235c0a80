"""gpt-oss's clamped SwiGLU: the op, the MLP option, the MoE option (every moe_experts kernel).

Values against the float64 reference (``reference.clamped_swiglu``: NumPy's clip and exp),
the property that a limit of ``inf`` and ``alpha = 1`` is the plain SwiGLU of ``up + 1``, and
bad input.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.core.dispatch import dispatcher
from portable_llm.testing import assert_close, random_array, random_weight, reference
from portable_llm.testing.strategies import seeds, shapes

X, E, INTER = 4, 8, 6  # experts, hidden size, expert width (JAX compiles per shape)
LIMITS = st.sampled_from([0.5, 2.0, 7.0])  # 0.5 and 2 clamp many of the values in [-3, 3]


@given(shape=shapes(max_dims=2, max_last=8), limit=LIMITS, seed=seeds())
def test_clamped_swiglu_matches_reference(backend, dtype, shape, limit, seed):
    g, g_r = random_array(seed, shape, dtype, backend=backend)
    u, u_r = random_array(seed + 1, shape, dtype, backend=backend)
    out = pl.clamped_swiglu(g, u, limit=limit, alpha=1.702)
    assert_close(
        out, reference.clamped_swiglu(g_r, u_r, limit, 1.702), backend=backend, dtype=dtype
    )


@given(shape=shapes(max_dims=2, max_last=8), seed=seeds())
def test_no_limit_and_alpha_one_is_the_swiglu_of_up_plus_one(backend, shape, seed):
    g, _ = random_array(seed, shape, "float32", backend=backend, low=-20.0, high=20.0)
    u, _ = random_array(seed + 1, shape, "float32", backend=backend, low=-20.0, high=20.0)
    out = pl.clamped_swiglu(g, u, limit=math.inf, alpha=1.0)
    assert_close(out, pl.silu(g) * (u + 1.0), backend=backend)


def test_clamping_caps_the_output(backend):
    # gate >= limit and |up| >= limit: every element is (limit + 1) * limit * sigmoid(alpha *
    # limit) or, for up <= -limit, (1 - limit) * the same.
    g = pl.asarray(np.array([8.0, 100.0, 7.0, 50.0], np.float32), backend=backend)
    u = pl.asarray(np.array([9.0, 1e4, -7.5, -1e4], np.float32), backend=backend)
    top = 7.0 / (1.0 + math.exp(-1.702 * 7.0))
    want = np.array([8.0 * top, 8.0 * top, -6.0 * top, -6.0 * top], np.float32)
    assert_close(pl.clamped_swiglu(g, u), want, backend=backend)


@given(seed=seeds(), limit=LIMITS)
def test_the_native_kernel_equals_the_portable_path(backend, dtype, seed, limit):
    """torch's five-op kernel against the portable path, values on both sides of the limit."""
    if dispatcher(pl.get_backend(backend)).native.get("clamped_swiglu") is None:
        pytest.skip(f"{backend} has no native clamped_swiglu")
    g, _ = random_array(seed, (3, 40), dtype, backend=backend, low=-20.0, high=20.0)
    u, _ = random_array(seed + 1, (3, 40), dtype, backend=backend, low=-20.0, high=20.0)
    native = pl.clamped_swiglu(g, u, limit=limit, impl="native")
    assert_close(native, pl.clamped_swiglu(g, u, limit=limit, impl="portable"), backend=backend,
                 dtype=dtype)  # fmt: skip


def _mlp_inputs(seed: int, dtype: str, backend: str) -> tuple[list, list]:
    shapes_ = [(2, 3, E), (INTER, E), (INTER, E), (E, INTER)]
    pairs = [
        (random_array if j == 0 else random_weight)(seed + j, s, dtype, backend=backend)
        for j, s in enumerate(shapes_)
    ]
    return [a for a, _ in pairs], [r for _, r in pairs]


@pytest.mark.parametrize("impl", ["auto", "portable"])
def test_mlp_with_a_swiglu_limit_matches_reference(backend, dtype, impl):
    arrays, refs = _mlp_inputs(0, dtype, backend)
    out = pl.mlp(*arrays, swiglu_limit=0.5, swiglu_alpha=1.702, impl=impl)
    want = reference.mlp(*refs, swiglu=(0.5, 1.702))
    assert_close(out, want, backend=backend, dtype=dtype)


def test_mlp_without_limit_and_alpha_one_is_swiglu_with_up_bias_plus_one(backend):
    arrays, _ = _mlp_inputs(1, "float64", backend)
    b_up, b_up_r = random_array(9, (INTER,), "float64", backend=backend)
    clamped = pl.mlp(*arrays, b_up=b_up, swiglu_limit=math.inf, swiglu_alpha=1.0)
    plus_one = pl.asarray(b_up_r + 1.0, backend=backend)
    assert_close(clamped, pl.mlp(*arrays, b_up=plus_one), backend=backend, dtype="float64")


def _moe_inputs(seed: int, dtype: str, backend: str) -> tuple[list, list]:
    shapes_ = [(2, 3, E), (X, E), (X, INTER, E), (X, INTER, E), (X, E, INTER)]
    pairs = [
        (random_array if j == 0 else random_weight)(seed + j, s, dtype, backend=backend)
        for j, s in enumerate(shapes_)
    ]
    return [a for a, _ in pairs], [r for _, r in pairs]


@pytest.mark.parametrize("impl", ["auto", "portable", "dense", "native"])
def test_moe_with_a_swiglu_limit_matches_reference(backend, dtype, impl):
    if impl == "native":
        nat = dispatcher(pl.get_backend(backend)).native.get("moe_experts")
        arrays, _ = _moe_inputs(0, dtype, backend)
        if nat is None or (nat.applies is not None and not nat.applies(arrays[0])):
            pytest.skip(f"{backend} has no moe_experts kernel for {dtype} here")
    arrays, refs = _moe_inputs(0, dtype, backend)
    kw = {"top_k": 2, "norm_topk_prob": True, "swiglu_limit": 0.5, "swiglu_alpha": 1.702}
    out = pl.moe(*arrays, **kw, impl=impl)
    want = reference.moe(*refs, top_k=2, norm_topk_prob=True, swiglu=(0.5, 1.702))
    assert_close(out, want, backend=backend, dtype=dtype)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda g, u: pl.clamped_swiglu(g, u, limit=0.0), ValueError,
         r"clamped_swiglu: swiglu_limit must be not NaN and > 0.0, got 0.0"),
        (lambda g, u: pl.clamped_swiglu(g, u, limit=math.nan), ValueError,
         r"clamped_swiglu: swiglu_limit must be"),
        (lambda g, u: pl.clamped_swiglu(g, u, alpha=math.inf), ValueError,
         r"clamped_swiglu: swiglu_alpha must be finite"),
        (lambda g, u: pl.clamped_swiglu(g, u, alpha="1"), TypeError,
         r"clamped_swiglu: swiglu_alpha must be a real number"),
        (lambda g, u: pl.clamped_swiglu(g, u[:, :2]), ValueError,
         r"clamped_swiglu: up must have gate's shape \(2, 3\), got \(2, 2\)"),
        (lambda g, u: pl.clamped_swiglu(g, u.astype(np.float64)), TypeError,
         r"clamped_swiglu: arrays must share one dtype, got gate: float32, up: float64"),
        (lambda g, u: pl.clamped_swiglu(g.astype(np.int32), u), TypeError,
         r"clamped_swiglu: gate must have a float dtype"),
        (lambda g, u: pl.mlp(np.zeros((1, 3), np.float32), g.T, g.T, g, act="gelu",
                             swiglu_limit=7.0), ValueError,
         r"mlp: swiglu_limit gives gpt-oss's clamped SwiGLU, .* act must be 'silu', got 'gelu'"),
        (lambda g, u: pl.mlp(np.zeros((1, 3), np.float32), g.T, g.T, g, swiglu_limit=-1.0),
         ValueError, r"mlp: swiglu_limit must be"),
        (lambda g, u: pl.moe(np.zeros((1, E), np.float32), np.zeros((X, E), np.float32),
                             np.zeros((X, INTER, E), np.float32),
                             np.zeros((X, INTER, E), np.float32),
                             np.zeros((X, E, INTER), np.float32), top_k=2, act="relu",
                             swiglu_limit=7.0), ValueError, r"moe: swiglu_limit gives"),
    ],
)  # fmt: skip
def test_bad_input(call, error, match):
    g = np.zeros((2, 3), np.float32)
    with pytest.raises(error, match=match):
        call(g, g.copy())
