"""rope, rope_cos_sin, apply_rope: values against the float64 reference, properties, the native
kernel against the portable path, bad input.

Values are drawn in [-1, 1] and positions stay below ~40: float32 angles ``m * theta`` carry an
error of about ``2 u m``, which at these positions stays inside float32's tolerance. Shapes come
from a few fixed ones: JAX compiles each op once per shape, so drawn shapes would dominate the
run time (so do the options that change the traced ops, such as dims).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.core.dispatch import dispatcher, pick
from portable_llm.rotary.rope import dispatch_args
from portable_llm.testing import assert_close, random_array, reference, tolerance
from portable_llm.testing.strategies import seeds

MPE = 16  # max_position_embeddings: dynamic scaling grows its base beyond it
SCALINGS: dict[str, dict | None] = {
    "default": None,
    "rope_theta": {"rope_type": "default", "rope_theta": 500.0},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"type": "dynamic", "factor": 3.0},  # the old key name "type"
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,  # bands at wavelengths 8 and 32: all three used
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
}


def _x(seed: int, shape: tuple[int, ...], dtype: str, backend: str) -> tuple:
    return random_array(seed, shape, dtype, backend=backend, low=-1.0, high=1.0)


def _rope_ref(xr: np.ndarray, positions: np.ndarray, **options) -> np.ndarray:
    return reference.rope(xr, positions, max_position_embeddings=MPE, **options)


@pytest.mark.parametrize("kind", list(SCALINGS))
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("offset", [0, 21])  # dynamic: below and beyond max_position_embeddings
def test_rope_matches_reference(backend, dtype, kind, traditional, offset):
    x, xr = _x(1, (2, 3, 5, 16), dtype, backend)
    opts = {"traditional": traditional, "scaling": SCALINGS[kind]}
    out = pl.rope(x, offset=offset, max_position_embeddings=MPE, **opts)
    want = _rope_ref(xr, np.arange(offset, offset + 5), **opts)
    assert_close(out, want, backend=backend, dtype=dtype)


@pytest.mark.parametrize("kind", ["default", "dynamic", "yarn_mscale"])
def test_rope_per_sequence_offsets_and_partial_dims_match_reference(backend, dtype, kind):
    x, xr = _x(2, (3, 2, 4, 20), dtype, backend)  # D = 20, rotate the first 12
    offsets = np.array([0, 7, 19])
    opts = {"scaling": SCALINGS[kind], "dims": 12}
    out = pl.rope(
        x, offset=pl.asarray(offsets, backend=backend), max_position_embeddings=MPE, **opts
    )
    positions = offsets[:, None] + np.arange(4)  # (B, L)
    assert_close(out, _rope_ref(xr, positions, **opts), backend=backend, dtype=dtype)


@given(
    partial=st.booleans(),
    offset=st.integers(0, 30),
    traditional=st.booleans(),
    kind=st.sampled_from(list(SCALINGS)),
    base=st.sampled_from([100.0, 10000.0, 1e6]),
    seed=seeds(),
)
def test_rope_drawn_options_match_reference(
    backend, dtype, partial, offset, traditional, kind, base, seed
):
    shape = (2, 3, 5, 10)
    x, xr = _x(seed, shape, dtype, backend)
    base = 500.0 if kind == "rope_theta" else base  # an explicit base must agree with the dict
    opts = {"traditional": traditional, "scaling": SCALINGS[kind], "dims": 6 if partial else None}
    out = pl.rope(x, offset=offset, base=base, max_position_embeddings=MPE, **opts)
    want = _rope_ref(xr, np.arange(offset, offset + shape[-2]), base=base, **opts)
    assert_close(out, want, backend=backend, dtype=dtype)


def test_rope_of_empty_sequence(backend):
    x, _ = _x(0, (2, 0, 8), "float32", backend)
    out = pl.rope(x, offset=5)
    assert tuple(out.shape) == (2, 0, 8) and pl.to_numpy(out).dtype == np.float32


@pytest.mark.parametrize("kind", ["default", "yarn_mscale", "dynamic"])
def test_rope_cos_sin_matches_reference(backend, dtype, kind):
    positions = np.array([[5, 0, 3, 30], [1, 1, 2, 17]])  # arbitrary ids, (B, L)
    scaling = SCALINGS[kind]
    cos, sin = pl.rope_cos_sin(
        pl.asarray(positions, backend=backend),
        10,
        scaling=scaling,
        max_position_embeddings=MPE,
        dtype=dtype,
    )
    theta, attention = reference.rope_frequencies(10, 10000.0, scaling, MPE, 31)
    angle = positions[..., None] * np.concatenate([theta, theta])  # HF layout (B, L, dims)
    assert_close(cos, attention * np.cos(angle), backend=backend, dtype=dtype)
    assert_close(sin, attention * np.sin(angle), backend=backend, dtype=dtype)


@pytest.mark.parametrize("traditional", [False, True])
def test_apply_rope_with_position_ids_matches_reference(backend, dtype, traditional):
    x, xr = _x(3, (2, 3, 4, 18), dtype, backend)  # (B, H, L, D), rotate 14 of 18
    positions = np.array([[9, 2, 2, 0], [4, 5, 6, 7]])  # (B, L), any order
    scaling = SCALINGS["llama3"]
    pos = pl.asarray(positions, backend=backend)
    cos, sin = pl.rope_cos_sin(pos, 14, scaling=scaling, dtype=dtype)  # (B, L, 14)
    out = pl.apply_rope(x, cos[:, None, ...], sin[:, None, ...], traditional=traditional)
    want = reference.rope(xr, positions, traditional=traditional, scaling=scaling, dims=14)
    assert_close(out, want, backend=backend, dtype=dtype)


def test_rope_is_apply_rope_of_rope_cos_sin(backend, dtype):
    x, _ = _x(4, (2, 3, 6, 16), dtype, backend)
    offsets = pl.asarray(np.array([4, 11]), backend=backend)
    positions = pl.asarray(np.array([4, 11])[:, None] + np.arange(6), backend=backend)
    scaling = SCALINGS["yarn_mscale"]
    cos, sin = pl.rope_cos_sin(positions, 16, scaling=scaling, dtype=dtype)
    composed = pl.apply_rope(x, cos[:, None, ...], sin[:, None, ...])
    assert_close(pl.rope(x, offset=offsets, scaling=scaling, impl="portable"), composed)


# -- properties ------------------------------------------------------------------------------


def _pair_norms(a: np.ndarray, dims: int, traditional: bool) -> np.ndarray:
    a = a.astype(np.float64)
    if traditional:
        first, second = a[..., 0:dims:2], a[..., 1:dims:2]
    else:
        first, second = a[..., : dims // 2], a[..., dims // 2 : dims]
    return np.hypot(first, second)


@given(
    offset=st.integers(0, 40),
    traditional=st.booleans(),
    kind=st.sampled_from(["default", "linear", "llama3", "yarn_mscale"]),
    seed=seeds(),
)
def test_rope_preserves_pair_norms(backend, dtype, offset, traditional, kind, seed):
    x, xr = _x(seed, (2, 5, 12), dtype, backend)
    scaling = SCALINGS[kind]
    out = pl.to_numpy(pl.rope(x, offset=offset, traditional=traditional, scaling=scaling))
    _, attention = reference.rope_frequencies(12, 10000.0, scaling)  # yarn scales the norms
    tol = tolerance(dtype, backend)
    assert_close(
        _pair_norms(out, 12, traditional),
        attention * _pair_norms(xr, 12, traditional),
        rtol=tol.rtol,
        atol=tol.atol,
    )


@given(
    m=st.integers(0, 40),
    n=st.integers(0, 40),
    shift=st.integers(0, 40),
    traditional=st.booleans(),
    seed=seeds(),
)
def test_rope_scores_depend_only_on_relative_position(backend, m, n, shift, traditional, seed):
    # A property of the math, checked in float64 where rounding is far below the tolerance (in
    # float32 the angles' own rounding, ~2u * position, would dominate).
    if "float64" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no float64")
    q, _ = _x(seed, (3, 8), "float64", backend)
    k, _ = _x(seed + 1, (3, 8), "float64", backend)

    def score(a: int, b: int) -> np.ndarray:
        qa = pl.to_numpy(pl.rope(q, offset=a, traditional=traditional))
        kb = pl.to_numpy(pl.rope(k, offset=b, traditional=traditional))
        return np.sum(qa * kb, axis=-1)

    tol = tolerance("float64", backend)
    assert_close(score(m + shift, n + shift), score(m, n), rtol=tol.rtol, atol=tol.atol)


@given(start=st.integers(0, 8), traditional=st.booleans(), seed=seeds())
def test_rope_offset_equals_slice_of_longer_input(backend, dtype, start, traditional, seed):
    x, _ = _x(seed, (2, 12, 12), dtype, backend)
    scaling = SCALINGS["llama3"]
    full = pl.rope(x, traditional=traditional, scaling=scaling)[:, start : start + 4, ...]
    part = x[:, start : start + 4, ...]  # (B, L=4, D)
    assert_close(pl.rope(part, offset=start, traditional=traditional, scaling=scaling), full)


@given(offsets=st.lists(st.integers(0, 30), min_size=3, max_size=3), seed=seeds())
def test_rope_per_sequence_offsets_equal_per_row_int_offsets(backend, dtype, offsets, seed):
    x, _ = _x(seed, (3, 2, 3, 8), dtype, backend)
    out = pl.rope(x, offset=pl.asarray(np.array(offsets), backend=backend))
    for b, off in enumerate(offsets):
        row = pl.rope(x[b : b + 1, ...], offset=off)
        assert_close(out[b : b + 1, ...], row, err_msg=f"row {b}")


@given(traditional=st.booleans(), seed=seeds())
def test_rope_partial_dims_leave_the_tail_untouched(backend, dtype, traditional, seed):
    dims = 6
    x, _ = _x(seed, (2, 4, 14), dtype, backend)
    out = pl.rope(x, offset=3, dims=dims, traditional=traditional)
    assert np.array_equal(pl.to_numpy(out[..., dims:]), pl.to_numpy(x[..., dims:]))
    head = pl.rope(x[..., :dims], offset=3, traditional=traditional)
    assert_close(out[..., :dims], head)


def _longrope(pairs: int, **extra) -> dict:
    """Phi-3's longrope: a factor per pair, short up to the original length 16, long beyond."""
    return {
        "rope_type": "longrope",
        "short_factor": np.linspace(1.0, 1.5, pairs).tolist(),
        "long_factor": np.linspace(1.0, 9.0, pairs).tolist(),
        "original_max_position_embeddings": 16,
        **extra,
    }


@pytest.mark.parametrize("attention", [None, 1.0])  # None: sqrt(1 + ln(48/16) / ln(16))
@pytest.mark.parametrize("offset", [0, 11, 21])  # positions up to 4 (short), 15 (long), 25
def test_longrope_matches_reference(backend, dtype, offset, attention):
    x, xr = _x(3, (2, 3, 5, 16), dtype, backend)
    scaling = _longrope(8, **({} if attention is None else {"attention_factor": attention}))
    out = pl.rope(x, offset=offset, scaling=scaling, max_position_embeddings=48)
    want = reference.rope(xr, np.arange(offset, offset + 5), scaling=scaling,
                          max_position_embeddings=48)  # fmt: skip
    assert_close(out, want, backend=backend, dtype=dtype)
    # per-sequence offsets: the largest position decides for the whole batch, as in HF
    offsets = np.array([0, offset])
    out = pl.rope(x[:, :, :4, ...], offset=pl.asarray(offsets, backend=backend), scaling=scaling,
                  max_position_embeddings=48)  # fmt: skip
    want = reference.rope(xr[:, :, :4], offsets[:, None] + np.arange(4), scaling=scaling,
                          max_position_embeddings=48)  # fmt: skip
    assert_close(out, want, backend=backend, dtype=dtype)
    cos, _ = pl.rope_cos_sin(pl.asarray(np.arange(offset, offset + 5), backend=backend), 16,
                             scaling=scaling, max_position_embeddings=48)  # fmt: skip
    theta, att = reference.rope_frequencies(16, 10000.0, scaling, 48, offset + 5)
    angle = np.arange(offset, offset + 5)[:, None] * np.concatenate([theta, theta])
    assert_close(cos, att * np.cos(angle), backend=backend, dtype="float32")


# -- native kernels --------------------------------------------------------------------------


def _native_rope(backend: str):
    nat = dispatcher(pl.get_backend(backend)).native.get("rope")
    if nat is None:
        pytest.skip(f"{backend} has no native rope kernel (the portable path is used)")
    return nat


def test_native_rope_matches_portable(backend, dtype):
    _native_rope(backend)
    x, _ = _x(5, (3, 2, 5, 24), dtype, backend)
    offsets = (0, 21, pl.asarray(np.array([0, 9, 30]), backend=backend))
    for kind, traditional, offset in itertools.product(SCALINGS, (False, True), offsets):
        opts = {"offset": offset, "traditional": traditional, "scaling": SCALINGS[kind]}
        opts |= {"dims": 16, "max_position_embeddings": MPE}
        case = f"{kind}, traditional={traditional}, offset={offset}"
        bk, arrays, options = dispatch_args(x, **opts)
        nat = dispatcher(bk).native["rope"]
        # The kernel has no factor on cos/sin (yarn's attention factor here), and its angles
        # are float32: auto leaves it out for float64, impl="native" still runs it there.
        expressible = not kind.startswith("yarn")
        assert nat.applies(*arrays, **options) == expressible, case
        takes_native = pick(bk, "rope", "auto", *arrays, **options) is nat.fn
        assert takes_native == (expressible and dtype != "float64"), case
        portable = pl.rope(x, impl="portable", **opts)
        if expressible:
            native = pl.rope(x, impl="native", **opts)
            if dtype == "float64":  # float32 angles: float32's accuracy
                tol = tolerance("float32")
                assert_close(native, portable, rtol=tol.rtol, atol=tol.atol, err_msg=case)
            else:
                assert_close(native, portable, err_msg=case)
        else:
            with pytest.raises(ValueError, match="cannot express"):
                pl.rope(x, impl="native", **opts)
        assert_close(pl.rope(x, **opts), portable, err_msg=case)


def test_native_rope_on_two_dimensional_input(backend):
    _native_rope(backend)
    x, _ = _x(6, (7, 8), "float32", backend)
    assert_close(pl.rope(x, offset=2, impl="native"), pl.rope(x, offset=2, impl="portable"))


def test_impl_native_without_kernel_is_an_error(backend):
    if dispatcher(pl.get_backend(backend)).native.get("rope") is not None:
        pytest.skip(f"{backend} has a native rope kernel")
    x, _ = _x(0, (2, 4), "float32", backend)
    with pytest.raises(ValueError, match="no native kernel"):
        pl.rope(x, impl="native")


# -- bad input -------------------------------------------------------------------------------

X = np.zeros((2, 3, 4, 8))


@pytest.mark.parametrize(
    ("x", "kwargs", "match"),
    [
        (np.zeros((2, 5)), {}, r"rope: x has an odd last dimension D=5 \(shape \(2, 5\)\)"),
        (X, {"dims": 10}, r"rope: dims must be an even int in \[2, D=8\] .*\(2, 3, 4, 8\).*10"),
        (X, {"dims": 3}, r"rope: dims must be an even int .* got 3"),
        (X, {"dims": 0}, r"rope: dims must be an even int .* got 0"),
        (X, {"offset": -1}, r"rope: offset must be >= 0, got -1"),
        (X, {"offset": np.array(-3)}, r"rope: offset must be >= 0, got negative entries"),
        (
            X,
            {"offset": 2**70},
            r"rope: positions must be <= 2\*\*31 - 1 .* got offset=1180591620717411303424 with L=4",
        ),
        (X, {"offset": 2**31 - 3}, r"rope: positions must be <= 2\*\*31 - 1"),
        (
            X,
            {"offset": np.array([1, 2, 3])},
            r"rope: an offset array must have shape \(\) or \(B,\) = \(2,\) .*\(2, 3, 4, 8\).* "
            r"got \(3,\)",
        ),
        (
            X,
            {"offset": np.zeros((2, 1), dtype=int)},
            r"rope: an offset array must have shape .* got \(2, 1\)",
        ),
        (
            np.zeros((4, 8)),
            {"offset": np.array([1, 2, 3, 4])},
            r"rope: an offset array of shape \(4,\) needs x of shape \(B, .., L, D\) "
            r".*got \(4, 8\)",
        ),
        (
            X,
            {"offset": np.array([1.0, 2.0])},
            r"rope: offset must be an integer array, got float64 with shape \(2,\)",
        ),
        (
            X,
            {"offset": np.array([1, -2])},
            r"rope: offset must be >= 0, got negative entries \(shape \(2,\)\)",
        ),
        (
            X,
            {"scaling": {"rope_type": "mrope"}},
            r"rope: unknown scaling type 'mrope'; "
            r"known types: default, linear, dynamic, llama3, yarn, longrope",
        ),
        (
            X,
            {"scaling": {"rope_type": "linear"}},
            r"rope: scaling of type 'linear' needs the field 'factor'",
        ),
        (
            X,
            {"scaling": {"rope_type": "linear", "factor": 0}},
            r"rope: scaling 'linear': factor must be > 0",
        ),
        (
            X,
            {"scaling": {"rope_type": "dynamic", "factor": 2.0}},
            r"rope: scaling of type 'dynamic' needs max_position_embeddings",
        ),
        (
            X,
            {
                "scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            r"needs the field 'low_freq_factor'",
        ),
        (
            X,
            {"scaling": {"rope_type": "yarn", "factor": 4.0}},
            r"rope: scaling of type 'yarn' needs 'original_max_position_embeddings'",
        ),
        (
            X,
            {
                "scaling": {
                    "rope_type": "yarn",
                    "factor": None,
                    "original_max_position_embeddings": 8,
                }
            },
            r"factor=None needs max_position_embeddings",
        ),
        (
            X,
            {"scaling": {"rope_theta": 1e6}, "base": 500.0},
            r"rope: base=500.0 disagrees with scaling\['rope_theta'\]=1000000.0",
        ),
        (
            X,
            {"scaling": {"partial_rotary_factor": 0.5}, "dims": 6},
            r"rope: dims=6 disagrees with scaling\['partial_rotary_factor'\]=0.5, .* = 4",
        ),
        (
            X,
            {"scaling": {"factor": 2.0}, "max_position_embeddings": 0},
            r"max_position_embeddings must be an int >= 1",
        ),
        (X, {"base": 1.0}, r"rope: base must be a number > 1, got 1.0"),
        (
            X,
            {
                "dims": 2,
                "scaling": {"rope_type": "dynamic", "factor": 2.0},
                "max_position_embeddings": 8,
            },
            r"rope: scaling 'dynamic' needs dims > 2",
        ),
        (
            np.zeros(8),
            {},
            r"rope: x must have at least 2 dimension\(s\) \(..., L, D\), got shape \(8,\)",
        ),
        (
            X,
            {"scaling": {**_longrope(4), "long_factor": None}},
            r"rope: scaling 'longrope': long_factor must be a non-empty list of numbers",
        ),
        (
            X,
            {"scaling": {**_longrope(4), "short_factor": [1.0, 0.0, 1.0, 1.0]}},
            r"rope: scaling 'longrope': short_factor\[1\] must be > 0",
        ),
        (
            X,
            {"scaling": _longrope(3), "max_position_embeddings": 64},
            r"short_factor has 3 entries but the rotated width dims=8 has 4 pairs",
        ),
        (
            X,
            {"scaling": _longrope(4)},
            r"'longrope' without 'factor' or 'attention_factor' needs max_position_embeddings",
        ),
    ],
)
def test_rope_bad_input(x, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pl.rope(x, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"offset": 1.5}, r"rope: offset must be an int >= 0 or an integer array, got float 1.5"),
        ({"offset": True}, r"rope: offset must be an int >= 0 or an integer array, got bool"),
        ({"offset": "3"}, r"rope: offset must be an int >= 0 or an integer array, got str"),
        ({"dims": 4.0}, r"rope: dims must be an int, got float 4.0"),
        ({"dims": True}, r"rope: dims must be an int, got bool True"),
        ({"base": True}, r"rope: base must be a real number, got bool True"),
        (
            {"scaling": {"rope_type": "linear", "factor": "2"}},
            r"rope: scaling 'linear': factor must be a real number, got str '2'",
        ),
    ],
)
def test_rope_rejects_non_numbers_with_a_type_error(kwargs, match):
    with pytest.raises(TypeError, match=match):
        pl.rope(X, **kwargs)


def test_rope_bad_types():
    with pytest.raises(TypeError, match="rope: x must have a float dtype"):
        pl.rope(np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(TypeError, match="rope: scaling must be None or a dict, got str"):
        pl.rope(X, scaling="linear")


def test_rope_partial_rotary_factor_sets_dims():
    x, xr = _x(0, (3, 10), "float64", "numpy")
    out = pl.rope(x, offset=1, scaling={"rope_type": "default", "partial_rotary_factor": 0.4})
    assert_close(out, reference.rope(xr, np.arange(1, 4), dims=4))


@pytest.mark.parametrize(
    ("positions", "dims", "kwargs", "match"),
    [
        (
            np.array([1.0, 2.0]),
            8,
            {},
            r"rope_cos_sin: positions must be an integer array, got float64",
        ),
        (np.array([1, -1]), 8, {}, r"rope_cos_sin: positions must be >= 0"),
        (np.array(3), 8, {}, r"rope_cos_sin: positions must have at least 1 dimension"),
        (np.arange(3), 7, {}, r"rope_cos_sin: dims must be an even int >= 2, got 7"),
        (
            np.arange(3),
            8,
            {"dtype": "int32"},
            r"rope_cos_sin: dtype must be a float dtype, got int32",
        ),
        (np.arange(3), 8, {"scaling": {"type": "su"}}, r"rope_cos_sin: unknown scaling type 'su'"),
    ],
)
def test_rope_cos_sin_bad_input(positions, dims, kwargs, match):
    with pytest.raises(ValueError, match=match):
        pl.rope_cos_sin(positions, dims, **kwargs)


@pytest.mark.parametrize(
    ("cos_shape", "sin_shape", "match"),
    [
        ((4, 8), (4, 6), r"apply_rope: cos and sin must have one shape, got \(4, 8\) and \(4, 6\)"),
        ((4, 10), (4, 10), r"apply_rope: dims must be an even int in \[2, D=8\] .* got 10"),
        ((4, 5), (4, 5), r"apply_rope: dims must be an even int .* got 5"),
        (
            (5, 4, 8),
            (5, 4, 8),
            r"apply_rope: cos and sin of shape \(5, 4, 8\) do not broadcast to \(2, 3, 4, 8\)",
        ),
        ((5, 4, 1, 4, 8), (5, 4, 1, 4, 8), r"do not broadcast to \(2, 3, 4, 8\)"),
    ],
)
def test_apply_rope_bad_input(cos_shape, sin_shape, match):
    with pytest.raises(ValueError, match=match):
        pl.apply_rope(X, np.ones(cos_shape), np.ones(sin_shape))


# -- scalar arguments, the position bound, empty input ------------------------------------------


def test_rope_numpy_integer_offset_equals_int(backend):
    x, _ = _x(0, (2, 2, 5, 8), "float32", backend)
    ref = pl.to_numpy(pl.rope(x, offset=5))
    for offset in (np.int64(5), np.int32(5), np.uint8(5)):
        np.testing.assert_array_equal(pl.to_numpy(pl.rope(x, offset=offset)), ref)


@pytest.mark.parametrize("impl", ["auto", "portable"])
def test_rope_last_position_works_on_every_backend(backend, impl):
    """The documented bound: offset + L - 1 <= 2**31 - 1 runs, one position more is refused."""
    L = 5
    x, xr = _x(0, (1, 2, L, 8), "float32", backend)
    offset = pl.rotary.args.MAX_POSITION - L + 1
    out = pl.rope(x, offset=offset, impl=impl)
    # At positions ~2**31 the float32 angle m * theta is rounded as HF rounds it; the NumPy
    # backend's portable path (the HF order) is the reference for that rounding.
    want = pl.rope(pl.asarray(xr.astype(np.float32)), offset=offset, impl="portable")
    assert_close(out, pl.to_numpy(want), backend=backend, dtype="float32")
    with pytest.raises(ValueError, match=r"rope: positions must be <= 2\*\*31 - 1"):
        pl.rope(x, offset=offset + 1, impl=impl)


@pytest.mark.parametrize("shape", [(1, 2, 3, 0), (1, 2, 0, 8), (1, 0, 3, 8), (0, 2, 3, 8)])
@pytest.mark.parametrize("impl", ["auto", "portable"])
def test_rope_of_empty_input_is_empty(backend, shape, impl):
    x, _ = _x(0, shape, "float32", backend)
    out = pl.rope(x, offset=3, impl=impl)
    assert tuple(out.shape) == shape and out.dtype == x.dtype
    if shape[0] == 0:  # per-sequence offsets of shape (B,) = (0,)
        offsets = pl.asarray(np.zeros((0,), np.int32), backend=backend)
        assert tuple(pl.rope(x, offset=offsets, impl=impl).shape) == shape


# -- JAX transforms: jit and grad ------------------------------------------------------------


def _jax_or_skip(backend: str) -> None:
    if backend != "jax":
        pytest.skip("jax.jit and jax.grad are JAX's")


@pytest.mark.parametrize("kind", ["default", "llama3", "yarn"])
def test_rope_under_jax_jit_equals_eager(backend, kind):
    _jax_or_skip(backend)
    import jax

    scaling = SCALINGS[kind]
    x, _ = _x(0, (2, 2, 5, 8), "float32", backend)
    eager = pl.rope(x, offset=3, scaling=scaling)
    f = jax.jit(lambda a: pl.rope(a, offset=3, scaling=scaling))
    assert_close(f(x), pl.to_numpy(eager), backend=backend, dtype="float32")
    # A second trace (new shape) and an eager call after it: nothing of the first trace leaked
    # into the frequency-table cache.
    x2, _ = _x(1, (2, 2, 7, 8), "float32", backend)
    want2 = pl.to_numpy(pl.rope(x2, offset=3, scaling=scaling))
    assert_close(f(x2), want2, backend=backend, dtype="float32")
    again = pl.rope(x, offset=3, scaling=scaling)
    assert_close(again, pl.to_numpy(eager), backend=backend, dtype="float32", rtol=0, atol=0)
    # traced per-sequence offsets, and rope_cos_sin of traced positions
    offsets = pl.asarray(np.array([0, 4], np.int32), backend=backend)
    g = jax.jit(lambda a, o: pl.rope(a, offset=o, scaling=scaling))
    want = pl.to_numpy(pl.rope(x, offset=offsets, scaling=scaling))
    assert_close(g(x, offsets), want, backend=backend, dtype="float32")
    positions = pl.asarray(np.arange(6).reshape(2, 3), backend=backend)
    cos = jax.jit(lambda p: pl.rope_cos_sin(p, 8, scaling=scaling)[0])(positions)
    want = pl.to_numpy(pl.rope_cos_sin(positions, 8, scaling=scaling)[0])
    assert_close(cos, want, backend=backend, dtype="float32")


def test_rope_under_jax_grad(backend):
    """RoPE is a rotation: the gradient of |rope(x)|^2 is 2x, and that of <rope(x), c> is the
    inverse rotation of c (rope at the negated positions, i.e. the transpose)."""
    _jax_or_skip(backend)
    import jax
    import jax.numpy as jnp

    x, xr = _x(0, (1, 2, 5, 8), "float64", backend)
    c, cr = _x(1, (1, 2, 5, 8), "float64", backend)
    g = jax.grad(lambda a: jnp.sum(pl.rope(a, offset=3) ** 2))(x)
    assert_close(g, 2 * xr, backend=backend, dtype="float64")
    g = jax.jit(jax.grad(lambda a: jnp.sum(pl.rope(a, offset=3) * c)))(x)
    positions = np.arange(3, 8)
    # rope at position m rotates each pair by m * theta; its transpose rotates by -m * theta.
    inverse = reference.rope(cr, -positions.astype(np.float64))
    assert_close(g, inverse, backend=backend, dtype="float64")
