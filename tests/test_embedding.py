"""embedding and unembed: table rows, the tied LM head, the id checks, tracing on JAX."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.testing import assert_close, random_array, random_weight, reference
from portable_llm.testing.strategies import seeds


def _ids(seed: int, shape: tuple[int, ...], vocab: int, dtype: str, backend: str) -> tuple:
    ids = np.random.default_rng(seed).integers(0, vocab, size=shape).astype(dtype)
    return pl.asarray(ids, backend=backend), ids


# Few distinct shapes (the values vary with the seed): JAX compiles each op once per shape.
ID_SHAPES = st.sampled_from([(1,), (6,), (2, 3), (2, 1, 4)])


@given(shape=ID_SHAPES, vocab=st.sampled_from([1, 40]), e=st.sampled_from([1, 5]),
       id_dtype=st.sampled_from(["int32", "int64"]), seed=seeds())  # fmt: skip
def test_embedding_is_the_table_rows(backend, dtype, shape, vocab, e, id_dtype, seed):
    table, table_r = random_array(seed, (vocab, e), dtype, backend=backend)
    ids, ids_r = _ids(seed + 1, shape, vocab, id_dtype, backend)
    out = pl.embedding(ids, table)
    want = reference.embedding(ids_r, table_r)
    assert_close(out, want, backend=backend, dtype=dtype)
    np.testing.assert_array_equal(pl.to_numpy(out).astype(np.float64), want)  # bit-exact


def test_embedding_hits_the_first_and_last_row(backend, dtype):
    table, table_r = random_array(0, (5, 3), dtype, backend=backend)
    ids = pl.asarray(np.array([[0, 4, 4], [4, 0, 2]]), backend=backend)
    out = pl.to_numpy(pl.embedding(ids, table)).astype(np.float64)
    np.testing.assert_array_equal(out, table_r[np.array([[0, 4, 4], [4, 0, 2]])])


@pytest.mark.parametrize("bad", [[0, 5], [-1, 2], [7]], ids=["V", "negative", "above"])
def test_embedding_rejects_out_of_range_ids(backend, bad):
    table, _ = random_array(0, (5, 3), "float32", backend=backend)
    ids = pl.asarray(np.array(bad), backend=backend)
    with pytest.raises(ValueError, match=r"embedding: ids must lie in \[0, 5\)"):
        pl.embedding(ids, table)


INT_DTYPES = [f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64)]


def _int_ids(values: list[int], id_dtype: str, backend: str):
    """``values`` as ids of ``id_dtype`` on ``backend``; skips where the backend lacks it."""
    try:
        ids = pl.asarray(np.array(values, dtype=id_dtype), backend=backend)
    except (TypeError, ValueError) as e:
        pytest.skip(f"{backend} has no {id_dtype}: {e}")
    if np.dtype(pl.to_numpy(ids).dtype) != np.dtype(id_dtype):
        pytest.skip(f"{backend} has no {id_dtype} (got {pl.to_numpy(ids).dtype})")
    return ids


@pytest.mark.parametrize("id_dtype", INT_DTYPES)
def test_embedding_takes_every_integer_width(backend, id_dtype):
    # torch's index_select wants int32/int64 and has no min/max for uint16..uint64.
    table, table_r = random_array(0, (100, 3), "float32", backend=backend)
    ids = _int_ids([[0, 99, 7], [42, 0, 99]], id_dtype, backend)
    out = pl.to_numpy(pl.embedding(ids, table)).astype(np.float64)
    np.testing.assert_array_equal(out, table_r[np.array([[0, 99, 7], [42, 0, 99]])])


@pytest.mark.parametrize(
    ("id_dtype", "bad"),
    [("int8", -1), ("uint8", 100), ("uint16", 65535), ("uint32", 2**31), ("uint32", 2**32 - 1),
     ("uint64", 2**63), ("uint64", 2**64 - 1), ("int64", 2**62)],
)  # fmt: skip
def test_embedding_rejects_out_of_range_ids_of_every_width(backend, id_dtype, bad):
    # An unsigned id beyond the signed range must not wrap onto another row; the message quotes
    # the id as given.
    table, _ = random_array(0, (100, 3), "float32", backend=backend)
    ids = _int_ids([3, bad], id_dtype, backend)
    lo, hi = min(3, bad), max(3, bad)
    with pytest.raises(ValueError, match=rf"ids must lie in \[0, 100\).*\[{lo}, {hi}\]"):
        pl.embedding(ids, table)


@pytest.mark.parametrize("ids", [np.array([0.0, 1.0]), np.array([True, False])], ids=["f", "b"])
def test_embedding_rejects_non_integer_ids(backend, ids):
    table, _ = random_array(0, (5, 3), "float32", backend=backend)
    with pytest.raises(ValueError, match="embedding: ids must have an integer dtype"):
        pl.embedding(pl.asarray(ids, backend=backend), table)


def test_embedding_rejects_bad_table(backend):
    table, _ = random_array(0, (5,), "float32", backend=backend)
    ids = pl.asarray(np.array([0, 1]), backend=backend)
    with pytest.raises(ValueError, match=r"embedding: table must have shape \(V, E\)"):
        pl.embedding(ids, table)
    with pytest.raises(TypeError, match="embedding: table must have a float dtype"):
        pl.embedding(ids, ids)


def test_embedding_of_no_ids_is_empty(backend):
    table, _ = random_array(0, (5, 3), "float32", backend=backend)
    ids = pl.asarray(np.zeros((2, 0), dtype=np.int64), backend=backend)
    out = pl.embedding(ids, table)
    assert_close(out, np.zeros((2, 0, 3), np.float32), backend=backend)


def test_embedding_under_jit_masks_out_of_range_ids(backend):
    if backend != "jax":
        pytest.skip("tracing (jax.jit) is JAX's")
    import jax

    table, table_r = random_array(0, (4, 3), "float32", backend="jax")
    ids = pl.asarray(np.array([0, 4, -1, 3]), backend="jax")
    out = pl.to_numpy(jax.jit(pl.embedding)(ids, table)).astype(np.float64)
    np.testing.assert_array_equal(out[[0, 3]], table_r[[0, 3]])
    assert np.isnan(out[[1, 2]]).all()  # never another token's row, never a wrap-around


@pytest.mark.parametrize("id_dtype", ["uint8", "uint32", "uint64"])
def test_embedding_under_jit_masks_unsigned_ids(backend, id_dtype):
    if backend != "jax":
        pytest.skip("tracing (jax.jit) is JAX's")
    import jax

    table, table_r = random_array(0, (4, 3), "float32", backend="jax")
    big = np.iinfo(id_dtype).max  # uint32/uint64: -1 once read as the signed type of its width
    ids = _int_ids([0, 4, big, 3], id_dtype, "jax")
    out = pl.to_numpy(jax.jit(pl.embedding)(ids, table)).astype(np.float64)
    np.testing.assert_array_equal(out[[0, 3]], table_r[[0, 3]])
    assert np.isnan(out[[1, 2]]).all()


@given(lead=st.sampled_from([(1,), (2, 3)]), vocab=st.sampled_from([1, 30]),
       e=st.sampled_from([1, 24]), seed=seeds())  # fmt: skip
def test_unembed_matches_reference(backend, dtype, lead, vocab, e, seed):
    h, h_r = random_array(seed, (*lead, e), dtype, backend=backend)
    table, table_r = random_weight(seed + 1, (vocab, e), dtype, backend=backend)
    out = pl.unembed(h, table)
    assert_close(out, reference.unembed(h_r, table_r), backend=backend, dtype=dtype)


def test_unembed_is_tied_to_embedding(backend, dtype):
    # The LM head of a tied model is linear with the embedding matrix as the weight.
    table, _ = random_weight(0, (6, 8), dtype, backend=backend)
    ids = pl.asarray(np.array([[3, 1]]), backend=backend)
    h = pl.embedding(ids, table)
    assert_close(pl.unembed(h, table), pl.linear(h, table), backend=backend, dtype=dtype)


def test_unembed_rejects_bad_shapes(backend):
    h, _ = random_array(0, (2, 8), "float32", backend=backend)
    table, _ = random_array(1, (6, 7), "float32", backend=backend)
    with pytest.raises(ValueError, match=r"unembed: table must have shape \(V, 8\)"):
        pl.unembed(h, table)
    bk = pl.get_backend(backend)
    table_int = bk.astype(random_array(1, (6, 8), "float32", backend=backend)[0], bk.dtype("int32"))
    with pytest.raises(TypeError, match="unembed: table must have a float dtype"):
        pl.unembed(h, table_int)
