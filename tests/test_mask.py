"""causal_mask: bottom-right alignment, sliding windows, boolean and additive forms, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.testing import reference

# A few sizes (JAX compiles each shape once), including empty, single and L > S.
sizes = st.sampled_from([0, 1, 2, 3, 5, 8])
windows = st.none() | st.integers(1, 10)


@given(L=sizes, S=sizes, window=windows)
def test_boolean_mask_matches_reference(backend, L, S, window):
    out = pl.causal_mask(L, S, window=window, backend=backend)
    bk = pl.get_backend(backend)
    assert pl.backends.backend_of(out) is bk
    assert out.dtype == bk.dtypes["bool"]
    assert np.array_equal(pl.to_numpy(out), reference.causal_mask(L, S, window))


@given(L=sizes, S=sizes, window=windows)
def test_additive_mask_is_zero_or_minus_inf(backend, dtype, L, S, window):
    out = pl.causal_mask(L, S, window=window, dtype=dtype, backend=backend)
    assert pl.get_backend(backend).dtype_name(out.dtype) == dtype
    expected = np.where(reference.causal_mask(L, S, window), 0.0, -np.inf)
    assert np.array_equal(pl.to_numpy(out).astype(np.float64), expected)


def test_dtype_may_be_a_backend_dtype_object(backend, dtype):
    bk = pl.get_backend(backend)
    out = pl.causal_mask(3, 5, dtype=bk.dtypes[dtype], backend=backend)
    assert out.dtype == bk.dtypes[dtype]
    out_bool = pl.causal_mask(3, 5, dtype=bk.dtypes["bool"], backend=backend)
    assert np.array_equal(pl.to_numpy(out_bool), reference.causal_mask(3, 5))


def test_layout_bottom_right():
    # Two new queries after three cached keys: positions 3 and 4 of 5.
    expected = np.array(
        [
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=bool,
    )
    assert np.array_equal(pl.causal_mask(2, 5), expected)
    # A window of 2: each query sees itself and the key before it.
    expected_w = np.array(
        [
            [0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=bool,
    )
    assert np.array_equal(pl.causal_mask(2, 5, window=2), expected_w)
    # L > S: the first L - S queries see nothing.
    assert not pl.causal_mask(4, 2)[:2].any()
    assert np.array_equal(pl.causal_mask(4, 2)[2:], np.array([[1, 0], [1, 1]], dtype=bool))


def test_default_backend_is_numpy():
    out = pl.causal_mask(2, 3)
    assert isinstance(out, np.ndarray) and out.dtype == np.bool_


def test_device_is_honoured():
    pytest.importorskip("array_api_strict")
    out = pl.causal_mask(3, 4, backend="array_api_strict", device="device1", dtype="float32")
    assert pl.device_of(out) == pl.get_backend("array_api_strict").device("device1")


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((-1, 3), {}, r"causal_mask: L must be an int >= 0, got -1"),
        ((2, 2.0), {}, r"causal_mask: S must be an int >= 0, got 2.0"),
        ((2, 3), {"window": 0}, r"causal_mask: window must be an int >= 1 or None, got 0"),
        ((2, 3), {"window": True}, r"causal_mask: window must be"),
        ((2, 3), {"dtype": "int32"}, r"causal_mask: dtype must be None, 'bool' or a float"),
        ((2, 3), {"dtype": "float8"}, r"causal_mask: .*float8"),
    ],
)
def test_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pl.causal_mask(*args, **kwargs)


def test_numpy_integer_window_is_an_int_window(backend):
    want = pl.to_numpy(pl.causal_mask(5, 7, window=2, backend=backend))
    got = pl.to_numpy(pl.causal_mask(5, 7, window=np.int64(2), backend=backend))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, reference.causal_mask(5, 7, window=2))


# -- the one visibility rule behind every mask ----------------------------------------------------


def _brute_visible(L, q_start, cols, window, ring, keep, pad):
    """A loop over (row, query, key): the rules of attn/visibility.py spelled out one by one."""
    B = 1 if pad is None else len(pad)
    out = np.zeros((B, L, len(cols)), dtype=bool)
    for b in range(B):
        for i in range(L):
            q = q_start + i
            for j, k in enumerate(cols):
                ok = k <= q
                ok = ok and (window is None or k > q - window)
                ok = ok and (ring is None or k < keep or k > q - ring)
                ok = ok and (pad is None or k >= pad[b])
                out[b, i, j] = ok
    return out


@pytest.mark.parametrize(
    ("L", "q_start", "cols", "window", "ring", "keep", "pad"),
    [
        (3, 4, list(range(7)), None, None, 0, None),  # bottom-right causal
        (3, 4, list(range(7)), 2, None, 0, None),  # a window
        (2, 9, [0, 1, 6, 7, 8, 9, 10], None, 5, 2, None),  # a wrapped ring with 2 sinks
        (1, 9, [0, 1, 8, 9, 5, 6, 7], 3, 5, 2, None),  # ring order, a window inside it
        (4, 3, list(range(7)), None, None, 0, [0, 2, 5]),  # left padding, fixed-size view
        (2, 9, [0, 1, 6, 7, 8, 9, 10], 4, 5, 2, [1, 0]),  # all four rules at once
    ],
)
def test_visible_is_the_rule_spelled_out(backend, L, q_start, cols, window, ring, keep, pad):
    from portable_llm.attn.visibility import visible

    bk = pl.get_backend(backend)
    k_pos = pl.asarray(np.array(cols), backend=backend)
    p = None if pad is None else pl.asarray(np.array(pad), backend=backend)
    got = visible(
        bk.xp, L, len(cols), q_start=q_start, k_pos=k_pos, window=window, ring=ring, keep=keep,
        pad=p,
    )  # fmt: skip
    want = _brute_visible(L, q_start, cols, window, ring, keep, pad)
    shape = (L, len(cols)) if pad is None else (len(pad), 1, L, len(cols))
    assert tuple(got.shape) == shape
    np.testing.assert_array_equal(pl.to_numpy(got).reshape(want.shape), want)


@given(L=sizes, S=sizes, window=windows)
def test_visible_defaults_are_causal_mask(backend, L, S, window):
    from portable_llm.attn.visibility import visible

    bk = pl.get_backend(backend)
    got = pl.to_numpy(visible(bk.xp, L, S, window=window))
    np.testing.assert_array_equal(got, reference.causal_mask(L, S, window))
