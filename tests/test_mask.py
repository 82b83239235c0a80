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
