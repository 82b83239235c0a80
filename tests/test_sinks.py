"""Attention sinks (gpt-oss): ``softmax([scores, sink])[:-1] @ v`` on every path and backend.

Values against the float64 reference (``reference.scaled_dot_product_attention(sinks=)``, a
loop over rows that appends the sink to each row's logits), properties (a sink of ``-inf`` is
plain attention; a sink only shrinks a row's weights, by one factor per row), the native
kernels (MLX's takes sinks, torch's and JAX's refuse them), the attention block, bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from conftest import numpy_only
from portable_llm.attn.sdpa import OP, sdpa_args
from portable_llm.core.dispatch import dispatcher, pick
from portable_llm.testing import assert_close, random_array, random_weight, reference
from portable_llm.testing.strategies import seeds

# (batch dims, H, H_kv, L, S, D, mask, window): GQA prefill with a window, a decode step (L=1)
# with a boolean mask that empties a row now and then. Few shapes: JAX compiles per shape.
SCENARIOS = [
    ((1,), 4, 2, 5, 7, 8, "causal", 3),
    ((2,), 2, 1, 1, 6, 4, "bool", None),
]
IMPLS = ["auto", "portable", "tiled"]


@st.composite
def problems(draw: st.DrawFn) -> dict:
    batch, h, h_kv, L, S, D, mask, window = draw(st.sampled_from(SCENARIOS))
    return {
        "batch": batch, "h": h, "h_kv": h_kv, "L": L, "S": S, "D": D, "mask": mask,
        "window": window, "seed": draw(seeds()),
    }  # fmt: skip


def _inputs(p: dict, dtype: str, backend: str) -> tuple[list, list, dict, dict]:
    """(q, k, v, sinks) on the backend, their float64 copies, the op's and the reference's
    mask options."""
    b, s = p["batch"], p["seed"]
    shapes = [(*b, p["h"], p["L"], p["D"]), (*b, p["h_kv"], p["S"], p["D"])]
    pairs = [random_array(s + i, shapes[min(i, 1)], dtype, backend=backend) for i in range(3)]
    pairs.append(random_array(s + 3, (p["h"],), dtype, backend=backend, low=-3.0, high=3.0))
    if p["mask"] == "causal":
        op = ref = {"mask": "causal", "window": p["window"]}
    else:
        allowed = np.random.default_rng(s).random((*b, p["h"], p["L"], p["S"])) < 0.6
        op, ref = {"mask": pl.asarray(allowed, backend=backend)}, {"mask": allowed}
    return [a for a, _ in pairs], [r for _, r in pairs], op, ref


@given(impl=st.sampled_from(IMPLS), p=problems(), block=st.sampled_from([2, 256]))
def test_sinks_match_reference(backend, dtype, impl, p, block):
    (q, k, v, sinks), (qr, kr, vr, sr), op, ref = _inputs(p, dtype, backend)
    out = pl.scaled_dot_product_attention(q, k, v, sinks=sinks, impl=impl, block_size=block, **op)
    want = reference.scaled_dot_product_attention(qr, kr, vr, sinks=sr, **ref)
    assert_close(out, want, backend=backend, dtype=dtype)


@given(impl=st.sampled_from(IMPLS), p=problems())
def test_a_sink_of_minus_inf_is_plain_attention(backend, impl, p):
    (q, k, v, _), _, op, _ = _inputs(p, "float32", backend)
    none = pl.asarray(np.full(p["h"], -np.inf, np.float32), backend=backend)
    out = pl.scaled_dot_product_attention(q, k, v, sinks=none, impl=impl, block_size=2, **op)
    assert_close(out, pl.scaled_dot_product_attention(q, k, v, impl="portable", **op))


@given(impl=st.sampled_from(IMPLS), p=problems())
def test_sinks_only_shrink_each_row_by_one_factor(backend, impl, p):
    # With v = 1 the output is each row's weight sum: in (0, 1) for a row that sees a key (the
    # sink takes the rest), 0 for one that sees none. The output with sinks is the plain output
    # times that sum: the sink rescales a row, it never reweights the keys among themselves.
    (q, k, v, sinks), _, op, _ = _inputs(p, "float64", backend)
    kw = {"impl": impl, "block_size": 2, **op}
    ones = pl.asarray(np.ones(pl.to_numpy(v).shape), backend=backend, dtype="float64")
    total = pl.to_numpy(pl.scaled_dot_product_attention(q, k, ones, sinks=sinks, **kw))[..., :1]
    plain = pl.to_numpy(pl.scaled_dot_product_attention(q, k, ones, **kw))[..., :1]
    seen = plain > 0.5  # 1 where the row sees a key, 0 where it sees none
    assert np.all((total > 0) & (total < 1) | ~seen) and np.all(total[~seen] == 0)
    got = pl.scaled_dot_product_attention(q, k, v, sinks=sinks, **kw)
    want = pl.to_numpy(pl.scaled_dot_product_attention(q, k, v, **kw)) * total
    assert_close(got, want, backend=backend, dtype="float64")


def test_a_huge_sink_takes_every_weight(backend):
    # exp(sink - max) stays <= 1 (no overflow): the keys' weights vanish, the output is 0.
    p = {"batch": (1,), "h": 4, "h_kv": 2, "L": 5, "S": 7, "D": 8, "mask": "causal",
         "window": None, "seed": 1}  # fmt: skip
    (q, k, v, _), _, op, _ = _inputs(p, "float32", backend)
    huge = pl.asarray(np.full(4, 1e30, np.float32), backend=backend)
    for impl in IMPLS:
        out = pl.scaled_dot_product_attention(q, k, v, sinks=huge, impl=impl, block_size=2, **op)
        zeros = np.zeros(pl.to_numpy(q).shape, np.float32)
        assert_close(out, zeros, backend=backend, err_msg=impl)


def test_native_kernels_take_sinks_or_refuse_them(backend):
    bk = pl.get_backend(backend)
    nat = dispatcher(bk).native.get(OP)
    if nat is None:
        pytest.skip(f"{backend} has no native attention kernel")
    p = {"batch": (1,), "h": 4, "h_kv": 2, "L": 5, "S": 7, "D": 8, "mask": "causal",
         "window": None, "seed": 2}  # fmt: skip
    (q, k, v, sinks), (qr, kr, vr, sr), op, ref = _inputs(p, "float32", backend)
    args, opts = sdpa_args(
        OP, bk, q, k, v, None, scale=None, window=None, softcap=None, block_size=256, sinks=sinks
    )
    assert len(args) == 5  # the sinks travel as the fifth array
    if not nat.applies(*args, **opts):  # torch's and JAX's: auto keeps the portable path
        assert pick(bk, OP, "auto", *args, **opts) is not nat.fn
        with pytest.raises(ValueError, match="cannot express these options"):
            pl.scaled_dot_product_attention(q, k, v, sinks=sinks, impl="native", **op)
        return
    out = pl.scaled_dot_product_attention(q, k, v, sinks=sinks, impl="native", **op)
    want = reference.scaled_dot_product_attention(qr, kr, vr, sinks=sr, **ref)
    assert_close(out, want, backend=backend, dtype="float32", err_msg=nat.kernel)


def test_attention_block_with_sinks_matches_reference(backend, dtype):
    b, L, E, h, h_kv, d = 2, 5, 16, 4, 2, 4
    arrays = {
        "x": random_array(0, (b, L, E), dtype, backend=backend),
        "wq": random_weight(1, (h * d, E), dtype, backend=backend),
        "wk": random_weight(2, (h_kv * d, E), dtype, backend=backend),
        "wv": random_weight(3, (h_kv * d, E), dtype, backend=backend),
        "wo": random_weight(4, (E, h * d), dtype, backend=backend),
        "sinks": random_array(5, (h,), dtype, backend=backend),
    }
    ops = {n: a for n, (a, _) in arrays.items()}
    refs = {n: r for n, (_, r) in arrays.items()}
    kw = {"num_heads": h, "num_kv_heads": h_kv, "head_dim": d, "window": 3}
    out = pl.attention(ops.pop("x"), **ops, **kw, rope={"base": 1e4})
    want = reference.attention(refs.pop("x"), **refs, **kw, rope_options={"base": 1e4})
    assert_close(out, want, backend=backend, dtype=dtype)


@pytest.mark.parametrize(
    ("sinks", "error", "match"),
    [
        (np.zeros(3, np.float32), ValueError,
         r"scaled_dot_product_attention: sinks must have shape \(4,\) \(one logit per query "
         r"head H of q \(1, 4, 5, 8\)\), got \(3,\)"),
        (np.zeros((1, 4), np.float32), ValueError, r"sinks must have shape \(4,\)"),
        (np.zeros(4, np.int32), TypeError, r"attention: sinks must have a float dtype"),
    ],
)  # fmt: skip
def test_bad_sinks(sinks, error, match):
    q = np.zeros((1, 4, 5, 8), np.float32)
    k = np.zeros((1, 2, 7, 8), np.float32)
    with pytest.raises(error, match=match):
        pl.scaled_dot_product_attention(q, k, k, sinks=sinks)


@pytest.mark.parametrize(
    ("sinks", "error", "match"),
    [
        (np.zeros(2, np.float32), ValueError,
         r"attention: sinks must have shape \(4,\) \(one logit per head, num_heads=4\), "
         r"got \(2,\)"),
        (np.zeros(4, bool), TypeError, r"attention: sinks must have a float"),
    ],
)  # fmt: skip
def test_attention_block_bad_sinks(sinks, error, match):
    x = np.zeros((1, 3, 16), np.float32)
    w = np.zeros((16, 16), np.float32)
    kv = np.zeros((8, 16), np.float32)
    with pytest.raises(error, match=match):
        pl.attention(x, wq=w, wk=kv, wv=kv, wo=w, num_heads=4, num_kv_heads=2, sinks=sinks)


@pytest.mark.parametrize("impl", ["auto", "portable", "blocked", "pool"])
def test_paged_attention_with_sinks_matches_reference(backend, impl):
    # Two rows of 7 and 3 keys in shuffled pages of 2; one decode query per row (L = 1, G = 2:
    # G * L <= P, so impl="pool" applies). Each row against the dense float64 reference.
    rng = np.random.default_rng(0)
    h, h_kv, page, lens = 4, 2, 2, (7, 3)
    need = [-(-n // page) for n in lens]
    pool = pl.PagePool(sum(need), page, h_kv, 8, "float32", backend=backend)
    ids = pool.allocate(sum(need))
    order = [ids[i] for i in rng.permutation(sum(need))]
    tables = np.zeros((2, max(need)), np.int32)
    keys = []
    for b, n in enumerate(lens):
        pages, order = order[: need[b]], order[need[b] :]
        tables[b, : need[b]] = pages
        (k, k64), (v, v64) = (random_array(10 * b + j, (h_kv, n, 8), "float32", backend=backend)
                              for j in (1, 2))  # fmt: skip
        pool.write(pages, 0, k, v)
        keys.append((k64, v64))
    q, q64 = random_array(5, (2, h, 1, 8), "float32", backend=backend)
    sinks, s64 = random_array(6, (h,), "float32", backend=backend, low=-3.0, high=3.0)
    out = pl.paged_attention(
        q, pool, pl.asarray(tables, backend=backend),
        pl.asarray(np.asarray(lens, np.int32), backend=backend), sinks=sinks, impl=impl,
        block_pages=1,
    )  # fmt: skip
    want = np.concatenate([
        reference.scaled_dot_product_attention(q64[b : b + 1], k64[None], v64[None],
                                               mask="causal", sinks=s64)
        for b, (k64, v64) in enumerate(keys)
    ])  # fmt: skip
    assert_close(out, want, backend=backend, dtype="float32")


@numpy_only
def test_a_registered_kernel_without_sinks_is_never_called_without_them():
    # A user's kernel written before sinks existed: auto must not run it and drop the sinks.
    def old_kernel(xp, q, k, v, mask, *, opts):  # no sinks parameter
        return pl.scaled_dot_product_attention(q, k, v, impl="portable")

    p = {"batch": (1,), "h": 4, "h_kv": 2, "L": 5, "S": 7, "D": 8, "mask": "causal",
         "window": None, "seed": 4}  # fmt: skip
    (q, k, v, sinks), _, op, _ = _inputs(p, "float32", "numpy")
    pl.register_kernel("numpy", OP, old_kernel)
    try:
        with pytest.raises(TypeError):
            pl.scaled_dot_product_attention(q, k, v, sinks=sinks, **op)
        assert_close(  # without sinks it still runs
            pl.scaled_dot_product_attention(q, k, v, **op),
            pl.scaled_dot_product_attention(q, k, v, impl="portable"),
        )
    finally:
        pl.unregister_kernel("numpy", OP)
