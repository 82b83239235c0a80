"""``portable_llm.testing.assert_close``: the check behind almost every test must itself fail.

Each test builds a pair that differs in exactly one respect (backend, shape, dtype, device,
values, NaN or infinity positions) and expects the matching ``AssertionError``; a regression
here would make the rest of the suite vacuous.
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close, compare_values, tolerance


def test_passes_within_the_dtype_tolerance(backend):
    tol = tolerance("float32", backend)
    d = np.linspace(-2.0, 2.0, 9)
    a = pl.asarray(d * (1 + tol.rtol / 2), backend=backend, dtype="float32")
    assert_close(a, d, backend=backend, dtype="float32")


def test_fails_beyond_the_dtype_tolerance(backend):
    tol = tolerance("float32", backend)
    d = np.linspace(1.0, 2.0, 9)
    off = d.copy()
    off[4] += 10 * (tol.atol + tol.rtol * d[4])
    a = pl.asarray(off, backend=backend, dtype="float32")
    with pytest.raises(AssertionError, match=r"1 of 9 elements differ .* worst at index \(4,\)"):
        assert_close(a, d, backend=backend, dtype="float32")


def test_fails_on_wrong_backend():
    pytest.importorskip("array_api_strict")
    a = pl.asarray([1.0], backend="array_api_strict", dtype="float32")
    with pytest.raises(AssertionError, match="backend: actual is array_api_strict, expected numpy"):
        assert_close(a, np.ones(1, np.float32), backend="numpy")


def test_fails_on_wrong_shape(backend):
    a = pl.asarray(np.ones((2, 3)), backend=backend, dtype="float32")
    with pytest.raises(AssertionError, match=r"shape: actual \(2, 3\), expected \(3, 2\)"):
        assert_close(a, np.ones((3, 2)), backend=backend, dtype="float32")


def test_fails_on_wrong_dtype(backend):
    a = pl.asarray(np.ones(3), backend=backend, dtype="float32")
    dtypes = pl.get_backend(backend).float_dtypes()
    other = "float64" if "float64" in dtypes else "float16"
    with pytest.raises(AssertionError, match=f"dtype: actual float32, expected {other}"):
        assert_close(a, np.ones(3), backend=backend, dtype=other)


def test_fails_on_wrong_device():
    pytest.importorskip("array_api_strict")
    b = "array_api_strict"
    a = pl.asarray([1.0], backend=b, dtype="float32", device="device1")
    with pytest.raises(AssertionError, match="device: actual on"):
        assert_close(a, np.ones(1), backend=b, dtype="float32", device="cpu")
    # Two arrays of one library: the expected device is the desired array's.
    d = pl.asarray([1.0], backend=b, dtype="float32")
    with pytest.raises(AssertionError, match=r"device: actual on .*desired on"):
        assert_close(a, d)


@pytest.mark.parametrize(
    ("actual", "message"),
    [
        ([np.nan, 1.0], "NaN positions differ: actual has 1, expected 0"),
        ([np.inf, 1.0], "infinities differ"),
        ([-np.inf, 1.0], "infinities differ"),
    ],
)
def test_fails_on_nan_or_inf_positions(backend, actual, message):
    a = pl.asarray(actual, backend=backend, dtype="float32")
    with pytest.raises(AssertionError, match=message):
        assert_close(a, np.array([2.0, 1.0]), backend=backend, dtype="float32")


def test_matching_nan_and_inf_positions_pass(backend):
    values = [np.nan, np.inf, -np.inf, 1.0]
    assert_close(pl.asarray(values, backend=backend, dtype="float32"), np.array(values),
                 backend=backend, dtype="float32")  # fmt: skip


def test_compare_values_reports_errors_without_raising():
    result = compare_values(np.array([1.0, 2.5]), np.array([1.0, 2.0]), rtol=0.0, atol=0.1)
    assert not result.ok and result.n_bad == 1 and result.size == 2
    assert result.max_abs == 0.5 and result.max_rel == 0.25
    assert compare_values(np.array([1.0]), np.array([1.05]), rtol=0.0, atol=0.1).ok


def test_not_an_array_fails():
    with pytest.raises(AssertionError, match="actual is not an array: list"):
        assert_close([1.0], np.ones(1))
