"""greedy, sample, logprobs: argmax, the filters' supports, reproducible draws, chi-square fit.

Draws are checked against :func:`portable_llm.testing.reference.sampling_probs`, the filtered
distribution computed row by row in float64 from the same (rounded) logits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.ops.sampling import GREEDY_BELOW
from portable_llm.testing import assert_close, random_array, reference
from portable_llm.testing.strategies import seeds

V = 12  # vocabulary of the property tests (one shape: JAX compiles each op once per shape)
ROWS = 400  # rows of logits per draw: 400 draws per call


def _logits(seed: int, dtype: str, backend: str, rows: int = 1) -> tuple:
    """One row of random logits (distinct, spread over [-4, 4]) repeated ``rows`` times."""
    x, x_r = random_array(seed, (1, V), dtype, backend=backend, low=-4, high=4)
    return pl.asarray(np.tile(pl.to_numpy(x), (rows, 1)), backend=backend), x_r[0]


def _draw(logits, **options) -> np.ndarray:
    return pl.to_numpy(pl.sample(logits, **options)).astype(np.int64)


# -- greedy ------------------------------------------------------------------------------------


@given(seed=seeds())
def test_temperature_zero_is_argmax(backend, dtype, seed):
    x, x_r = random_array(seed, (3, 2, V), dtype, backend=backend, low=-4, high=4)
    want = np.argmax(x_r, axis=-1)  # first occurrence on ties, as greedy
    ids = pl.sample(x, temperature=0, top_k=3, key=seed)
    np.testing.assert_array_equal(pl.to_numpy(ids), want)
    np.testing.assert_array_equal(pl.to_numpy(pl.greedy(x)), want)


def test_greedy_breaks_ties_by_the_lower_id(backend, dtype):
    x = pl.asarray(np.array([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0]], dtype), backend=backend)
    np.testing.assert_array_equal(pl.to_numpy(pl.greedy(x)), [1, 0])


def test_one_row_gives_a_scalar_id(backend):
    x, x_r = random_array(0, (V,), "float32", backend=backend)
    ids = pl.sample(x, key=0)
    assert tuple(ids.shape) == ()
    assert 0 <= int(pl.to_numpy(ids)) < V
    assert int(pl.to_numpy(pl.greedy(x))) == int(np.argmax(x_r))


# -- the filters: supports and values ----------------------------------------------------------


@given(seed=seeds(), k=st.integers(1, V), temperature=st.sampled_from([0.5, 1.0, 2.0]))
def test_top_k_never_picks_outside_the_k_largest(backend, dtype, seed, k, temperature):
    x, x_r = _logits(seed, dtype, backend, ROWS)
    allowed = np.argsort(-x_r, kind="stable")[:k]
    ids = _draw(x, temperature=temperature, top_k=k, key=seed)
    assert np.isin(ids, allowed).all(), (sorted(set(ids) - set(allowed)), allowed)


@given(seed=seeds(), top_p=st.floats(0.05, 1.0))
def test_top_p_never_picks_outside_the_nucleus(backend, dtype, seed, top_p):
    x, x_r = _logits(seed, dtype, backend, ROWS)
    p = np.sort(reference.softmax(x_r))[::-1]
    assume(np.abs(np.cumsum(p) - top_p).min() > 1e-4)  # no boundary within rounding of top_p
    nucleus = np.flatnonzero(reference.sampling_probs(x_r, top_p=top_p))
    ids = _draw(x, top_p=top_p, key=seed)
    assert np.isin(ids, nucleus).all(), (sorted(set(ids) - set(nucleus)), nucleus)
    # The nucleus is the shortest prefix reaching top_p: without its last token it falls short.
    assert reference.softmax(x_r)[nucleus].sum() >= top_p
    assert np.sort(reference.softmax(x_r)[nucleus])[1:].sum() < top_p


@given(seed=seeds(), min_p=st.floats(0.0, 1.0))
def test_min_p_never_picks_below_the_threshold(backend, dtype, seed, min_p):
    x, x_r = _logits(seed, dtype, backend, ROWS)
    p = reference.softmax(x_r)
    assume(np.abs(p / p.max() - min_p).min() > 1e-4)
    ids = _draw(x, min_p=min_p, key=seed)
    assert (p[ids] >= min_p * p.max()).all()


@given(seed=seeds(), temperature=st.sampled_from([0.3, 1.0, 1.7]),
       top_k=st.none() | st.integers(1, V), top_p=st.none() | st.floats(0.05, 1.0),
       min_p=st.none() | st.floats(0.0, 1.0))  # fmt: skip
def test_logprobs_match_reference(backend, dtype, seed, temperature, top_k, top_p, min_p):
    x, x_r = random_array(seed, (2, V), dtype, backend=backend, low=-4, high=4)
    for row in x_r:  # no filter boundary within rounding error
        p = np.sort(reference.softmax(row / temperature))[::-1]
        if top_k is not None:
            p = p[:top_k] / p[:top_k].sum()
        assume(top_p is None or np.abs(np.cumsum(p) - top_p).min() > 1e-4)
        assume(min_p is None or np.abs(p / p.max() - min_p).min() > 1e-4)
    options = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    lp = pl.logprobs(x, **options)
    want = reference.sampling_probs(x_r, **options)
    float_out = "float64" if dtype == "float64" else "float32"
    np.testing.assert_array_equal(np.isfinite(pl.to_numpy(lp)), want > 0)  # the same support
    with np.errstate(divide="ignore"):
        assert_close(lp, np.log(want), backend=backend, dtype=float_out)
    ids, lp2 = pl.sample(x, key=seed, return_logprobs=True, **options)
    assert_close(lp2, lp)
    assert (want[np.arange(2), pl.to_numpy(ids)] > 0).all()


def test_logprobs_at_temperature_zero_are_the_point_mass(backend, dtype):
    x, x_r = random_array(0, (3, V), dtype, backend=backend)
    lp = pl.to_numpy(pl.logprobs(x, temperature=0)).astype(np.float64)
    want = np.full((3, V), -np.inf)
    want[np.arange(3), np.argmax(x_r, axis=-1)] = 0.0
    np.testing.assert_array_equal(lp, want)


# -- reproducibility ---------------------------------------------------------------------------


def test_a_seed_gives_the_same_draws(backend):
    x, _ = _logits(0, "float32", backend, ROWS)
    first = _draw(x, key=1234, top_k=8)
    np.testing.assert_array_equal(_draw(x, key=1234, top_k=8), first)
    assert len(set(first)) > 1  # rows draw independently
    assert not np.array_equal(_draw(x, key=1235, top_k=8), first)


def test_the_backends_own_generator_or_key(backend):
    bk = pl.get_backend(backend)
    x, _ = _logits(0, "float32", backend, ROWS)
    # An int seed is a fresh generator (key) seeded with it.
    np.testing.assert_array_equal(_draw(x, key=bk.rng(7, x)), _draw(x, key=7))
    # Two generators (keys) from one seed give the same sequence of draws, whether the
    # generator advances (NumPy, torch) or the key is reused as is (MLX, JAX).
    a, b = bk.rng(7, x), bk.rng(7, x)
    seq_a = [_draw(x, key=a) for _ in range(2)]
    seq_b = [_draw(x, key=b) for _ in range(2)]
    np.testing.assert_array_equal(seq_a, seq_b)


def test_sample_under_jit_equals_eager(backend):
    if backend != "jax":
        pytest.skip("tracing (jax.jit) is JAX's")
    import jax

    x, _ = _logits(0, "float32", "jax", ROWS)
    key = jax.random.key(3)
    jitted = jax.jit(lambda logits, k: pl.sample(logits, key=k, top_k=5, top_p=0.9))
    np.testing.assert_array_equal(
        pl.to_numpy(jitted(x, key)), _draw(x, key=key, top_k=5, top_p=0.9)
    )


# -- goodness of fit ---------------------------------------------------------------------------


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df >= x), exactly, for integer df (scipy is not a dependency).

    Even df: a Poisson tail, ``exp(-x/2) sum_{i < df/2} (x/2)^i / i!``. Odd df: ``erfc(sqrt(x/2))
    + sqrt(2x/pi) exp(-x/2) sum_{i=1}^{(df-1)/2} x^(i-1) / (1*3*...*(2i-1))``.
    """
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, df // 2):
            term *= (x / 2) / i
            total += term
        return math.exp(-x / 2) * total
    term, total = 1.0, 0.0
    for i in range(1, (df - 1) // 2 + 1):
        term = 1.0 if i == 1 else term * x / (2 * i - 1)
        total += term
    return math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2) * total


def test_chi2_sf_matches_tabulated_critical_values():
    # Critical values from standard chi-square tables (alpha = 0.05 and 1e-4).
    for x, df, alpha in [(3.841, 1, 0.05), (5.991, 2, 0.05), (11.070, 5, 0.05),
                         (15.137, 1, 1e-4), (25.745, 5, 1e-4), (33.720, 9, 1e-4)]:  # fmt: skip
        assert abs(chi2_sf(x, df) / alpha - 1) < 2e-3


#: Significance of the goodness-of-fit tests. The draws are deterministic (fixed seeds), so a
#: failure is never bad luck on a rerun; alpha bounds the chance that a correct sampler fails
#: when a seed is changed: over the ~100 cases (5 backends x 4 dtypes x 5 filter settings) the
#: chance that any fails is about 1%. With N = 40000 draws the test still detects a shift of
#: one percentage point of mass between two tokens of probability ~0.2 (noncentrality
#: N * sum(delta^2 / p) = 40 against a critical value of ~30 for 8 degrees of freedom).
ALPHA = 1e-4
N_DRAWS = 40_000


@pytest.mark.parametrize(
    "options",
    [{}, {"temperature": 0.7, "top_k": 6}, {"top_p": 0.8}, {"temperature": 1.3, "min_p": 0.1},
     {"temperature": 0.9, "top_k": 9, "top_p": 0.95, "min_p": 0.05}],
    ids=["plain", "top_k", "top_p", "min_p", "all"],
)  # fmt: skip
def test_draws_fit_the_target_distribution(backend, dtype, options):
    # Logits of a spread-out distribution: every kept token is expected >= 5 times by far.
    x_r = np.log(np.linspace(1.0, 3.0, V))[::-1]
    x = pl.asarray(np.tile(x_r, (N_DRAWS, 1)).astype(dtype), backend=backend)
    x_r = pl.to_numpy(x[:1, ...]).astype(np.float64)[0]
    target = reference.sampling_probs(x_r, **options)
    counts = np.bincount(_draw(x, key=20240601, **options), minlength=V)
    kept = target > 0
    assert counts[~kept].sum() == 0, counts
    expected = N_DRAWS * target[kept]
    assert expected.min() >= 5  # the chi-square approximation holds
    stat = float(((counts[kept] - expected) ** 2 / expected).sum())
    p_value = chi2_sf(stat, int(kept.sum()) - 1)
    assert p_value > ALPHA, (stat, counts, target)


# -- infinite and NaN logits, tiny temperatures ------------------------------------------------


def test_plus_inf_logits_share_the_mass(backend, dtype):
    # softmax's limit: the +inf tokens are equally likely, every other token impossible.
    row = [1.0, math.inf, 2.0, -math.inf, math.inf, 0.0]
    x = pl.asarray(np.tile(np.array(row, dtype), (ROWS, 1)), backend=backend)
    ids, lp = pl.sample(x, key=0, return_logprobs=True, temperature=0.7)
    ids = pl.to_numpy(ids)
    assert set(ids.tolist()) == {1, 4}  # both drawn, nothing else
    ninf, half = -math.inf, math.log(0.5)
    float_out = "float64" if dtype == "float64" else "float32"
    want = np.array([[ninf, half, ninf, ninf, half, ninf]])
    assert_close(lp[:1, ...], want, backend=backend, dtype=float_out)
    one = np.array([[ninf, 0.0, ninf, ninf, ninf, ninf]])
    np.testing.assert_array_equal(pl.to_numpy(pl.logprobs(x[:1, ...], top_k=1)), one)
    assert (pl.to_numpy(pl.greedy(x)) == 1).all()  # ties: the lower id


def test_a_row_without_a_distribution_gives_id_minus_one(backend, dtype):
    # A NaN logit, or every logit -inf: no token to draw. Reading the logits back to raise would
    # sync the device on every step, so the row is marked on the device instead: id -1 (which
    # pl.embedding rejects) and NaN log-probs; the other rows are unaffected.
    x = pl.asarray(np.array([[0.0, math.nan, 1.0, 2.0], [-math.inf] * 4, [0.0, 3.0, 1.0, 2.0]],
                            dtype), backend=backend)  # fmt: skip
    for t in (1.0, 0.0):
        ids, lp = pl.sample(x, key=0, temperature=t, top_k=2, return_logprobs=True)
        np.testing.assert_array_equal(pl.to_numpy(ids), [-1, -1, 1])
        lp = pl.to_numpy(lp)
        assert np.isnan(lp[:2]).all() and not np.isnan(lp[2]).any()
    np.testing.assert_array_equal(pl.to_numpy(pl.greedy(x)), [-1, -1, 1])
    assert np.isnan(pl.to_numpy(pl.logprobs(x))[:2]).all()


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 9.9e-6])
def test_a_temperature_below_greedy_below_is_greedy(backend, dtype, temperature):
    # x / 1e-45 overflows float32: without the threshold the draw would be NaN or random.
    assert temperature < GREEDY_BELOW
    x, x_r = random_array(0, (ROWS, V), dtype, backend=backend, low=-4, high=4)
    want = np.argmax(x_r, axis=-1)
    ids, lp = pl.sample(x, temperature=temperature, top_p=0.5, return_logprobs=True)  # no key
    np.testing.assert_array_equal(pl.to_numpy(ids), want)
    np.testing.assert_array_equal(pl.to_numpy(lp), pl.to_numpy(pl.logprobs(x, temperature=0)))


def test_a_small_temperature_above_the_threshold_does_not_overflow(backend, dtype):
    # (x - max) / T <= 0: a large gap gives a very negative log-prob (or -inf), never +inf/NaN.
    x = pl.asarray(np.array([[-3.0e4, 1.0, 3.0, 2.0, -math.inf]], dtype), backend=backend)
    ids, lp = pl.sample(x, temperature=1e-5, key=0, return_logprobs=True)
    assert int(pl.to_numpy(ids)[0]) == 2
    lp = pl.to_numpy(lp).astype(np.float64)[0]
    assert lp[2] == 0 and (lp[[0, 1, 3, 4]] < -9e4).all() and lp[4] == -np.inf


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"top_k": 0}, ValueError, r"top_k must be in \[1, V\] = \[1, 12\]"),
        ({"top_k": V + 1}, ValueError, r"top_k must be in \[1, V\]"),
        ({"top_k": 2.0}, TypeError, "top_k must be an int"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"min_p": -0.1}, ValueError, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.1}, ValueError, r"min_p must be in \[0, 1\]"),
        ({"temperature": -1.0}, ValueError, "temperature must be finite and >= 0"),
        ({"temperature": math.nan}, ValueError, "temperature must be finite and >= 0"),
        ({"temperature": math.inf}, ValueError, "temperature must be finite and >= 0"),
        ({"key": "seed"}, TypeError, "sample: key must be None, an int seed or"),
        ({"key": -1}, ValueError, r"sample: key: an int seed must be in \[0, 2\*\*63\)"),
    ],
)
def test_sample_rejects_bad_options(backend, options, error, match):
    x, _ = random_array(0, (2, V), "float32", backend=backend)
    with pytest.raises(error, match=f"sample: {match}" if "sample" not in match else match):
        pl.sample(x, **{"key": 0, **options})


def test_sample_rejects_bad_logits(backend):
    x, _ = random_array(0, (2, V), "float32", backend=backend)
    ids = pl.greedy(x)
    with pytest.raises(TypeError, match="sample: logits must have a float dtype"):
        pl.sample(ids, key=0)
    with pytest.raises(ValueError, match="greedy: logits must have at least 1 dimension"):
        pl.greedy(x[0, 0])
