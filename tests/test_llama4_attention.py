"""Llama 4's attention pieces: chunked attention in the one visibility rule, and the temperature
tuning of the queries of its no-RoPE layers; against the float64 reference, on every backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.attn.visibility import visible
from portable_llm.testing import assert_close, random_array, reference
from portable_llm.testing.strategies import seeds


def _xp(backend: str) -> Any:
    return pl.get_backend(backend).xp


@given(
    L=st.integers(1, 9),
    extra=st.integers(0, 9),
    chunk=st.integers(1, 6),
    window=st.one_of(st.none(), st.integers(1, 6)),
)
def test_chunked_visibility_matches_reference(backend, L, extra, chunk, window):
    S = L + extra
    got = pl.to_numpy(visible(_xp(backend), L, S, chunk=chunk, window=window))
    np.testing.assert_array_equal(got, reference.causal_mask(L, S, window, chunk))


def test_chunks_by_hand(backend):
    """Chunks of 3 over 7 positions: {0, 1, 2}, {3, 4, 5}, {6}."""
    got = pl.to_numpy(visible(_xp(backend), 7, 7, chunk=3)).astype(int)
    want = np.array([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 1],
    ])  # fmt: skip
    np.testing.assert_array_equal(got, want)


@given(L=st.integers(1, 8), extra=st.integers(0, 8))
def test_a_chunk_covering_everything_is_causal(backend, L, extra):
    S = L + extra
    xp = _xp(backend)
    np.testing.assert_array_equal(
        pl.to_numpy(visible(xp, L, S, chunk=S)), pl.to_numpy(visible(xp, L, S))
    )


def test_decode_rows_equal_the_full_mask(backend):
    """One query at each offset (a decode step after a cache of S - 1 keys) sees the row of the
    full mask: the chunk follows the query's column, not its row."""
    xp = _xp(backend)
    full = pl.to_numpy(visible(xp, 10, 10, chunk=4))
    for S in range(1, 11):
        np.testing.assert_array_equal(pl.to_numpy(visible(xp, 1, S, chunk=4))[0], full[S - 1, :S])


# -- temperature tuning -------------------------------------------------------------------------


@given(seed=seeds(), offset=st.sampled_from([0, 5, 8189, 16380, 10**6]), L=st.integers(1, 6))
def test_attention_temperature_matches_reference(backend, dtype, seed, offset, L):
    q, qr = random_array(seed, (2, 3, L, 8), dtype, backend=backend)
    got = pl.attention_temperature(q, offset=offset, floor_scale=8192, scale=0.1)
    want = reference.attention_temperature(qr, np.arange(offset, offset + L), 8192, 0.1)
    assert_close(got, want, backend=backend, dtype=dtype)


def test_attention_temperature_is_one_below_floor_scale(backend, dtype):
    """Positions p with p + 1 < floor_scale keep q exactly; p = floor_scale - 1 is the first
    scaled one (log(2) * scale + 1)."""
    q, qr = random_array(0, (1, 2, 4, 8), dtype, backend=backend)
    same = pl.attention_temperature(q, offset=8188, floor_scale=8192, scale=0.1)
    out = pl.to_numpy(same).astype(np.float64)
    np.testing.assert_array_equal(out[..., :3, :], qr[..., :3, :])
    assert_close(same[..., 3:, :], qr[..., 3:, :] * (np.log(2.0) * 0.1 + 1.0), dtype=dtype,
                 backend=backend)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"offset": -1}, ValueError, "attention_temperature: offset must be >= 0"),
        ({"floor_scale": 0.0}, ValueError, "attention_temperature: floor_scale must be"),
        ({"scale": "0.1"}, TypeError, "attention_temperature: scale must be a real number"),
    ],
)
def test_attention_temperature_bad_arguments(kwargs, error, match):
    q, _ = random_array(0, (2, 4, 8), "float32")
    with pytest.raises(error, match=match):
        pl.attention_temperature(q, **kwargs)
    with pytest.raises(ValueError, match=r"q must have at least 2 dimension"):
        pl.attention_temperature(q[0, 0])
