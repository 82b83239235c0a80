"""short_conv: LFM2's and Mamba's causal depthwise convolution with its rolling state.

Values against the float64 step-by-step reference (``reference.short_conv``) on every backend,
dtype and implementation (portable, recurrent, native); the properties: one call over a sequence
equals token-by-token calls that pass the state along, ``all_states`` are the states those calls
return, a split sequence equals the whole, the output of a token depends on no later token, the
backends agree; bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.core.dispatch import dispatcher
from portable_llm.testing import assert_close, random_array, reference
from portable_llm.testing.strategies import conv_dims, seeds

IMPLS = ["auto", "portable", "recurrent", "native"]


def _inputs(seed: int, dims: tuple[int, ...], dtype: str, backend: str) -> tuple[list, list]:
    B, L, C, K = dims
    shapes = [(B, L, C), (C, K), (C,), (B, K - 1, C)]
    pairs = [random_array(seed + j, s, dtype, backend=backend) for j, s in enumerate(shapes)]
    return [a for a, _ in pairs], [r for _, r in pairs]


def _skip_without_native(backend: str, impl: str) -> None:
    if impl == "native" and "short_conv" not in dispatcher(pl.get_backend(backend)).native:
        pytest.skip(f"{backend} has no native short_conv")


@pytest.mark.slow_on("jax", dtypes=("float64",))  # JAX: float32 checks the adapter
@pytest.mark.parametrize("impl", IMPLS)
@given(dims=conv_dims(), act=st.sampled_from([None, "silu"]), seed=seeds())
def test_matches_reference(backend, dtype, impl, dims, act, seed):
    _skip_without_native(backend, impl)
    (x, w, b, s), refs = _inputs(seed, dims, dtype, backend)
    y, state = pl.short_conv(x, w, bias=b, state=s, activation=act, impl=impl)
    want_y, want_state = reference.short_conv(*refs, activation=act)
    assert_close(y, want_y, backend=backend, dtype=dtype)
    assert_close(state, want_state, backend=backend, dtype=dtype)


@pytest.mark.slow_on("jax")  # a program per drawn shape; the reference tests run there
@given(dims=conv_dims(), seed=seeds())
def test_steps_equal_the_sequence_and_all_states(backend, dims, seed):
    (x, w, b, s), _ = _inputs(seed, dims, "float32", backend)
    whole, last = pl.short_conv(x, w, bias=b, state=s, activation="silu")
    _, every = pl.short_conv(x, w, bias=b, state=s, activation="silu", all_states=True)
    outs, state = [], s
    for t in range(x.shape[1]):
        y, state = pl.short_conv(x[:, t : t + 1, :], w, bias=b, state=state, activation="silu")
        outs.append(pl.to_numpy(y))
        assert_close(every[:, t, ...], state)  # exact: the states are the inputs themselves
    assert_close(whole, np.concatenate(outs, axis=1), backend=backend)
    assert_close(last, state)


@pytest.mark.slow_on("jax")  # a program per drawn shape; the reference tests run there
@given(dims=conv_dims(), cut=st.integers(1, 5), seed=seeds())
def test_a_split_sequence_equals_the_whole_and_ignores_the_future(backend, dims, cut, seed):
    (x, w, b, s), _ = _inputs(seed, dims, "float32", backend)
    L = x.shape[1]
    cut = min(cut, L)
    whole, last = pl.short_conv(x, w, bias=b, state=s)
    head, mid = pl.short_conv(x[:, :cut, :], w, bias=b, state=s)
    assert_close(head, pl.to_numpy(whole)[:, :cut], backend=backend)  # causal: no later token
    if cut < L:
        tail, end = pl.short_conv(x[:, cut:, :], w, bias=b, state=mid)
        assert_close(tail, pl.to_numpy(whole)[:, cut:], backend=backend)
        assert_close(end, last)


def test_backends_agree(other_backend):
    (x, w, b, s), refs = _inputs(3, (2, 6, 8, 4), "float32", other_backend)
    got, state = pl.short_conv(x, w, bias=b, state=s, activation="silu")
    want, want_state = pl.short_conv(*(np.float32(r) for r in refs[:2]), bias=np.float32(refs[2]),
                                     state=np.float32(refs[3]), activation="silu")  # fmt: skip
    assert_close(got, pl.to_numpy(want), backend=other_backend)
    assert_close(state, pl.to_numpy(want_state), backend=other_backend)


def test_the_newest_input_meets_the_last_tap(backend):
    # One channel, taps (1, 10, 100): the output at token t is x[t-2] + 10 x[t-1] + 100 x[t].
    x = pl.asarray(np.array([[[1.0], [2.0], [3.0]]], np.float32), backend=backend)
    w = pl.asarray(np.array([[1.0, 10.0, 100.0]], np.float32), backend=backend)
    y, state = pl.short_conv(x, w)
    assert_close(y, np.array([[[100.0], [210.0], [321.0]]], np.float32), backend=backend)
    assert_close(state, np.array([[[2.0], [3.0]]], np.float32), backend=backend)


_X, _W = np.zeros((2, 3, 4), np.float32), np.zeros((4, 3), np.float32)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"x": _X[0]}, ValueError, r"short_conv: x must have shape \(B, L, C\)"),
        ({"x": _X[:, :0]}, ValueError, r"short_conv: x must hold at least one token"),
        ({"weight": _W[:3]}, ValueError,
         r"short_conv: weight must have shape \(C, K\) = \(4, \?\), got \(3, 3\)"),
        ({"bias": np.zeros(3, np.float32)}, ValueError, r"short_conv: bias must have shape"),
        ({"state": np.zeros((2, 3, 4), np.float32)}, ValueError,
         r"short_conv: state must have shape \(B, K - 1, C\) = \(2, 2, 4\), got \(2, 3, 4\)"),
        ({"activation": "gelu"}, ValueError, r"short_conv: activation must be one of"),
        ({"all_states": 1}, TypeError, r"short_conv: all_states must be a bool"),
        ({"x": _X.astype(np.int32)}, TypeError, r"short_conv: x must have a float dtype"),
        ({"impl": "tiled"}, ValueError, r"short_conv: impl must be one of"),
    ],
)  # fmt: skip
def test_bad_input(kwargs, error, match):
    args = {"x": _X, "weight": _W, **kwargs}
    x, w = args.pop("x"), args.pop("weight")
    with pytest.raises(error, match=match):
        pl.short_conv(x, w, **args)
