"""scaled_dot_product_attention: reference values, native == portable == tiled, properties, errors.

Every case runs on each backend and each float dtype it supports, against the independent
float64 NumPy formula in ``portable_llm.testing.reference``
(K/V repeated with ``np.repeat``, explicit
masks, a loop over query rows), on the same (rounded) inputs.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.attn.sdpa import OP, TILED_MIN_SCORES, sdpa_args
from portable_llm.core.dispatch import dispatcher, pick
from portable_llm.testing import TOLERANCES, assert_close, random_array, random_weight, reference
from portable_llm.testing.strategies import seeds

# The scenarios the Hypothesis tests draw from; the values (seeds) vary freely. A fixed catalogue,
# not arbitrary sizes and options: JAX compiles one program per shape and static option set, and
# a few scenarios keep its cache warm across examples and tests. Together they cover: no batch
# dims and two; MHA, GQA and MQA; prefill (L == S), chunked prefill (L < S) and decode (L = 1);
# D = 1; every mask kind (a boolean mask per head, an additive one shared by the heads, a 2-d
# one with a window); softcap.
# (batch dims, H, H_kv, L, S, D, mask kind, window, softcap)
SCENARIOS = [
    ((), 2, 1, 3, 5, 4, "none", None, None),
    ((), 2, 1, 3, 5, 4, "causal", None, 5.0),
    ((2, 1), 6, 2, 5, 6, 16, "window", 2, None),
    ((2, 1), 6, 2, 5, 6, 16, "bool", None, None),
    ((1,), 3, 3, 1, 7, 4, "additive", None, None),
    ((1,), 3, 3, 1, 7, 4, "bool+window", 4, None),
    ((1,), 4, 1, 9, 9, 1, "causal", None, None),
    ((1,), 4, 1, 9, 9, 1, "additive", None, 5.0),
    ((2,), 4, 2, 1, 6, 8, "causal", None, None),  # a decode step: its query sees every key
]
# Longer key sequences for the tiled path: several blocks, a ragged last one.
LONG_SCENARIOS = [
    ((1,), 2, 1, 7, 40, 8, "bool", None, None),
    ((), 4, 2, 33, 33, 4, "window", 4, 5.0),
    ((), 4, 2, 33, 33, 4, "additive", None, None),
]
# Windows of the causal properties: each value is a compiled variant on JAX.
WINDOWS = [1, 2, 4]


@st.composite
def problems(draw: st.DrawFn, *, scenarios: list = SCENARIOS) -> dict:
    """One attention call: a scenario of the catalogue and a seed for its values."""
    batch, h, h_kv, L, S, D, mask, window, softcap = draw(st.sampled_from(scenarios))
    return {
        "batch": batch, "h": h, "h_kv": h_kv, "L": L, "S": S, "D": D,
        "mask": mask, "window": window, "softcap": softcap, "seed": draw(seeds()),
    }  # fmt: skip


def qkv(p: dict, dtype: str, backend: str):
    b, L, S, D = p["batch"], p["L"], p["S"], p["D"]
    q = random_array(p["seed"], (*b, p["h"], L, D), dtype, backend=backend)
    k = random_array(p["seed"] + 1, (*b, p["h_kv"], S, D), dtype, backend=backend)
    v = random_array(p["seed"] + 2, (*b, p["h_kv"], S, D), dtype, backend=backend)
    return q, k, v


def mask_args(p: dict, backend: str, dtype: str) -> tuple[dict, dict]:
    """Keyword arguments for the op and for the reference, for the problem's mask kind."""
    kind, L, S = p["mask"], p["L"], p["S"]
    rng = np.random.default_rng(p["seed"] + 3)
    # A random mask that leaves some rows empty now and then: (B.., H, L, S) for "bool",
    # (B.., 1, L, S) for "additive", (L, S) with a window.
    heads = {"bool": (*p["batch"], p["h"]), "additive": (*p["batch"], 1)}.get(kind, ())
    shape = (*heads, L, S)
    allowed = rng.random(shape) < 0.7
    op: dict = {"softcap": p["softcap"]}
    ref: dict = {"softcap": p["softcap"]}
    if kind == "causal":
        op["mask"] = ref["mask"] = "causal"
    if kind in ("window", "bool+window"):
        op["window"] = ref["window"] = p["window"]
    if kind in ("bool", "bool+window"):
        op["mask"] = pl.asarray(allowed, backend=backend)
        ref["mask"] = allowed
    if kind == "additive":
        values = np.where(allowed, rng.uniform(-2.0, 2.0, shape), -np.inf)
        op["mask"] = pl.asarray(values, backend=backend, dtype=dtype)
        ref["mask"] = pl.to_numpy(op["mask"]).astype(np.float64)  # the rounded mask
    return op, ref


# Drawn by Hypothesis rather than parametrized: each run of a property covers all three paths.
IMPLS = ["auto", "portable", "tiled"]


@given(impl=st.sampled_from(IMPLS), p=problems(), block=st.sampled_from([2, 3, 256]))
def test_sdpa_matches_reference(backend, dtype, impl, p, block):
    (q, qr), (k, kr), (v, vr) = qkv(p, dtype, backend)
    op_kw, ref_kw = mask_args(p, backend, dtype)
    out = pl.scaled_dot_product_attention(q, k, v, impl=impl, block_size=block, **op_kw)
    expected = reference.scaled_dot_product_attention(qr, kr, vr, **ref_kw)
    assert_close(out, expected, backend=backend, dtype=dtype)


def test_scale_and_float32_accumulation(backend, dtype):
    # 512 keys: a half-precision running sum would be off by far more than the tolerance.
    (q, qr), (k, kr), (v, vr) = (
        random_array(s, shape, dtype, backend=backend)
        for s, shape in ((1, (2, 4, 3, 16)), (2, (2, 2, 512, 16)), (3, (2, 2, 512, 16)))
    )
    for impl in IMPLS:
        out = pl.scaled_dot_product_attention(q, k, v, scale=0.05, impl=impl, block_size=96)
        expected = reference.scaled_dot_product_attention(qr, kr, vr, scale=0.05)
        assert_close(out, expected, backend=backend, dtype=dtype, err_msg=impl)


# -- native == portable == tiled -------------------------------------------------------------


def _native(backend: str):
    nat = dispatcher(pl.get_backend(backend)).native.get(OP)
    if nat is None:
        pytest.skip(f"{backend} has no native attention kernel")
    return nat


@given(p=problems())
def test_native_matches_portable(backend, dtype, p):
    nat = _native(backend)
    (q, _), (k, _), (v, _) = qkv(p, dtype, backend)
    op_kw, _ = mask_args(p, backend, dtype)
    bk = pl.get_backend(backend)
    args, opts = sdpa_args(
        OP, bk, q, k, v, op_kw.get("mask"), scale=None, window=op_kw.get("window"),
        softcap=op_kw["softcap"], block_size=256,
    )  # fmt: skip
    portable_fn = pick(bk, OP, "portable", *args, **opts)
    portable = portable_fn(bk.xp, *args, **opts)
    auto = pick(bk, OP, "auto", *args, **opts)
    if not nat.applies(*args, **opts):
        assert auto is portable_fn
        with pytest.raises(ValueError, match="cannot express these options"):
            pick(bk, OP, "native", *args, **opts)
        return
    out = nat.fn(bk.xp, *args, **opts)
    if nat.auto(*args, **opts):
        assert auto is nat.fn
        assert_close(out, portable, err_msg=nat.kernel)
    else:  # a dtype auto leaves to the portable path: float64 computed at float32 precision
        assert auto is portable_fn and dtype == "float64"
        f32 = TOLERANCES["float32"]
        assert_close(out, portable, rtol=f32.rtol, atol=f32.atol, err_msg=nat.kernel)


def test_native_decode_step_matches_portable(backend):
    """One query over S keys with mask="causal" (the decode step every cache makes)."""
    nat = _native(backend)
    p = {"batch": (2,), "h": 4, "h_kv": 2, "L": 1, "S": 6, "D": 8, "seed": 3}
    (q, _), (k, _), (v, _) = qkv(p, "float32", backend)
    got = pl.scaled_dot_product_attention(q, k, v, mask="causal", impl="native")
    want = pl.scaled_dot_product_attention(q, k, v, mask="causal", impl="portable")
    assert_close(got, want, err_msg=nat.kernel)
    assert_close(want, pl.scaled_dot_product_attention(q, k, v, impl="portable"))


def test_native_declines_what_it_cannot_express(backend):
    _native(backend)
    (q, _), (k, _), (v, _) = (
        random_array(s, (1, 2, 3, 4), "float32", backend=backend) for s in (0, 1, 2)
    )
    with pytest.raises(ValueError, match="cannot express"):
        pl.scaled_dot_product_attention(q, k, v, softcap=10.0, impl="native")
    auto = pl.scaled_dot_product_attention(q, k, v, softcap=10.0)
    assert_close(auto, pl.scaled_dot_product_attention(q, k, v, softcap=10.0, impl="portable"))


@given(p=problems(scenarios=LONG_SCENARIOS), block=st.sampled_from([7, 16, 41]))
def test_tiled_matches_direct(backend, p, block):
    (q, _), (k, _), (v, _) = qkv(p, "float32", backend)
    op_kw, _ = mask_args(p, backend, "float32")
    direct = pl.scaled_dot_product_attention(q, k, v, impl="portable", **op_kw)
    tiled = pl.scaled_dot_product_attention(q, k, v, impl="tiled", block_size=block, **op_kw)
    assert_close(tiled, direct)


def test_tiled_compiles_one_block_step_not_one_program_per_block(backend):
    # 384 one-key blocks, a causal window and a mask. Compiled as one program, the Python loop
    # over blocks unrolls (JAX: minutes for this call); compiled block by block, it reuses one
    # compilation of the block step for every block (well under a second).
    (q, _), (k, _), (v, _), (mask, _) = (
        random_array(s, shape, "float32", backend=backend)
        for s, shape in enumerate([(2, 4, 3, 8), (2, 2, 384, 8), (2, 2, 384, 8), (2, 1, 3, 384)])
    )
    kw = {"mask": mask, "window": 300, "softcap": 20.0}
    tiled = pl.scaled_dot_product_attention(q, k, v, impl="tiled", block_size=1, **kw)
    assert_close(tiled, pl.scaled_dot_product_attention(q, k, v, impl="portable", **kw))


def test_auto_takes_tiled_for_long_sequences_without_a_fused_kernel():
    bk = pl.get_backend("numpy")
    n = int(TILED_MIN_SCORES**0.5)
    q = np.zeros((1, 1, n, 2), np.float32)
    opts = dict(scale=1.0, causal=False, window=None, softcap=None, block_size=256)
    assert pick(bk, OP, "auto", q, q, q, None, **opts) is pick(bk, OP, "tiled", q, q, q, None)
    short = q[:, :, : n // 2]
    direct = pick(bk, OP, "portable", short, q, q, None)
    assert pick(bk, OP, "auto", short, q, q, None, **opts) is direct


def test_tiled_memory_is_bounded_by_the_block():
    # One head, 32 queries over 8192 keys: the direct path holds 32 x 8192 float32 scores (1 MiB)
    # and their exponentials; the tiled path holds 32 x 256 per block.
    (q, _), (k, _), (v, _) = (
        random_array(s, shape, "float32")
        for s, shape in ((0, (1, 32, 8)), (1, (1, 8192, 8)), (2, (1, 8192, 8)))
    )
    peaks = {}
    for impl in ("portable", "tiled"):
        tracemalloc.start()
        out = pl.scaled_dot_product_attention(q, k, v, impl=impl, block_size=256)
        peaks[impl] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        peaks[impl + "_out"] = out
    assert_close(peaks["tiled_out"], peaks["portable_out"])
    assert peaks["portable"] > 32 * 8192 * 4 * 2  # scores and exponentials
    assert peaks["tiled"] < peaks["portable"] / 4, peaks


# -- properties ------------------------------------------------------------------------------
# In float32: the reference and native tests above cover every dtype; these check structure.


@given(impl=st.sampled_from(IMPLS), p=problems())
def test_gqa_equals_mha_with_repeated_kv(backend, impl, p):
    (q, _), (k, _), (v, _) = qkv(p, "float32", backend)
    group = p["h"] // p["h_kv"]
    k_rep = pl.asarray(np.repeat(pl.to_numpy(k), group, axis=-3), backend=backend)
    v_rep = pl.asarray(np.repeat(pl.to_numpy(v), group, axis=-3), backend=backend)
    op_kw, _ = mask_args(p, backend, "float32")
    gqa = pl.scaled_dot_product_attention(q, k, v, impl=impl, **op_kw)
    assert_close(gqa, pl.scaled_dot_product_attention(q, k_rep, v_rep, impl=impl, **op_kw))


@given(
    impl=st.sampled_from(IMPLS),
    p=problems(),
    cut=st.integers(0, 8),
    window=st.none() | st.sampled_from(WINDOWS),
)
def test_causal_outputs_ignore_the_future(backend, impl, p, cut, window):
    (q, _), (k, kr), (v, vr) = qkv(p, "float32", backend)
    L, S = p["L"], p["S"]
    cut = min(cut, S - 1)  # keys after position `cut` change
    rng = np.random.default_rng(p["seed"])
    k2, v2 = kr.copy(), vr.copy()
    k2[..., cut + 1 :, :] = rng.uniform(-3, 3, k2[..., cut + 1 :, :].shape)
    v2[..., cut + 1 :, :] = rng.uniform(-3, 3, v2[..., cut + 1 :, :].shape)
    k2, v2 = (pl.asarray(a, backend=backend, dtype="float32") for a in (k2, v2))
    kw = {"window": window} if window else {"mask": "causal"}
    before = pl.to_numpy(pl.scaled_dot_product_attention(q, k, v, impl=impl, **kw))
    after = pl.to_numpy(pl.scaled_dot_product_attention(q, k2, v2, impl=impl, **kw))
    rows = max(0, cut - (S - L) + 1)  # queries at absolute positions <= cut
    assert_close(after[..., :rows, :], before[..., :rows, :])


@given(impl=st.sampled_from(IMPLS), p=problems(), extra=st.sampled_from([0, 3]))
def test_window_at_least_s_is_no_window(backend, impl, p, extra):
    (q, _), (k, _), (v, _) = qkv(p, "float32", backend)
    windowed = pl.scaled_dot_product_attention(q, k, v, window=p["S"] + extra, impl=impl)
    assert_close(windowed, pl.scaled_dot_product_attention(q, k, v, mask="causal", impl=impl))


@given(
    impl=st.sampled_from(IMPLS),
    p=problems(),
    window=st.none() | st.sampled_from(WINDOWS),
    additive=st.booleans(),
)
def test_causal_string_equals_explicit_mask(backend, impl, p, window, additive):
    (q, _), (k, _), (v, _) = qkv(p, "float32", backend)
    # The additive form in q's dtype, so native kernels that want that take it too.
    explicit = pl.causal_mask(
        p["L"], p["S"], window=window, backend=backend, dtype="float32" if additive else None
    )
    implicit = pl.scaled_dot_product_attention(
        q, k, v, **({"window": window} if window else {"mask": "causal"}), impl=impl
    )
    assert_close(pl.scaled_dot_product_attention(q, k, v, mask=explicit, impl=impl), implicit)


@given(impl=st.sampled_from(IMPLS), p=problems(), c=st.integers(-16, 16))
def test_constant_added_to_additive_mask_changes_nothing(backend, impl, p, c):
    # float32 only, like softmax's shift invariance: mask + c is exact to ~2^-20.
    (q, _), (k, _), (v, _) = qkv(p, "float32", backend)
    rng = np.random.default_rng(p["seed"])
    m = rng.uniform(-2, 2, (p["L"], p["S"]))
    m[:, -1] = 0.0  # every row sees at least one key
    m[rng.random(m.shape) < 0.3] = -np.inf
    base = pl.asarray(m, backend=backend, dtype="float32")
    shifted = pl.asarray(m + c, backend=backend, dtype="float32")
    out = pl.scaled_dot_product_attention(q, k, v, mask=shifted, impl=impl)
    assert_close(out, pl.scaled_dot_product_attention(q, k, v, mask=base, impl=impl))


@given(impl=st.sampled_from(IMPLS), p=problems(), perm_seed=seeds())
def test_permuting_keys_and_values_together_changes_nothing(backend, impl, p, perm_seed):
    (q, _), (k, _), (v, _) = qkv(p, "float32", backend)
    perm = np.random.default_rng(perm_seed).permutation(p["S"])
    kp = pl.asarray(pl.to_numpy(k)[..., perm, :], backend=backend)
    vp = pl.asarray(pl.to_numpy(v)[..., perm, :], backend=backend)
    out = pl.scaled_dot_product_attention(q, kp, vp, impl=impl, softcap=p["softcap"])
    assert_close(out, pl.scaled_dot_product_attention(q, k, v, impl=impl, softcap=p["softcap"]))


@pytest.mark.parametrize("impl", [*IMPLS, "native"])
@pytest.mark.parametrize("form", ["bool", "additive"])
def test_fully_masked_rows_are_zero(backend, dtype, impl, form):
    (q, _), (k, _), (v, _) = (
        random_array(s, shape, dtype, backend=backend)
        for s, shape in ((0, (2, 4, 3, 8)), (1, (2, 2, 5, 8)), (2, (2, 2, 5, 8)))
    )
    allowed = np.ones((2, 1, 3, 5), dtype=bool)
    allowed[0, 0, 1] = False  # batch 0, query 1 sees nothing
    allowed[1, 0, 2] = False
    mask = (
        pl.asarray(allowed, backend=backend)
        if form == "bool"
        else pl.asarray(np.where(allowed, 0.0, -np.inf), backend=backend, dtype=dtype)
    )
    if impl == "native":
        nat = _native(backend)
        args, opts = sdpa_args(
            OP, pl.get_backend(backend), q, k, v, mask, scale=None, window=None, softcap=None,
            block_size=256,
        )  # fmt: skip
        if not nat.auto(*args, **opts):
            pytest.skip(f"auto does not take {nat.kernel} for {dtype} {form} masks")
    out = pl.scaled_dot_product_attention(q, k, v, mask=mask, impl=impl, block_size=2)
    got = pl.to_numpy(out).astype(np.float64)
    assert not np.isnan(got).any()
    assert np.array_equal(got[0, :, 1], np.zeros((4, 8)))
    assert np.array_equal(got[1, :, 2], np.zeros((4, 8)))
    assert_close(out, pl.scaled_dot_product_attention(q, k, v, impl="portable", mask=mask))


def test_one_key_returns_its_value(backend, dtype):
    (q, _), (k, _), (v, vr) = (
        random_array(s, (2, 1, 1, 3), dtype, backend=backend) for s in (0, 1, 2)
    )
    for impl in IMPLS:
        for mask in (None, "causal"):
            out = pl.scaled_dot_product_attention(q, k, v, mask=mask, impl=impl)
            assert_close(out, vr, backend=backend, dtype=dtype, err_msg=f"{impl} {mask}")


def test_output_dtype_and_backend_follow_q(backend, dtype):
    (q, _), (k, _), (v, _) = (random_array(s, (3, 2, 4), dtype, backend=backend) for s in (0, 1, 2))
    for impl in IMPLS:
        out = pl.scaled_dot_product_attention(q, k, v, impl=impl)
        assert pl.backends.backend_of(out) is pl.get_backend(backend)
        assert out.dtype == q.dtype and tuple(out.shape) == (3, 2, 4)


def test_backend_argument_converts_inputs(other_backend):
    (q, qr), (k, kr), (v, vr) = (random_array(s, (1, 2, 3, 4), "float32") for s in (0, 1, 2))
    out = pl.scaled_dot_product_attention(q, k, v, mask="causal", backend=other_backend)
    expected = reference.scaled_dot_product_attention(qr, kr, vr, mask="causal")
    assert_close(out, expected, backend=other_backend, dtype="float32")


# -- bad input -------------------------------------------------------------------------------


def _arr(*shape, dtype="float32"):
    return np.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(
    ("q", "k", "v", "kwargs", "error", "match"),
    [
        (_arr(1, 3, 2, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4), {}, ValueError,
         r"scaled_dot_product_attention: q's heads H=3 must be a multiple of k's heads H_kv=2; "
         r"q \(1, 3, 2, 4\), k \(1, 2, 5, 4\)"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 5, 4), _arr(1, 2, 6, 4), {}, ValueError,
         r"k \(B.., H_kv, S, D\) and v \(B.., H_kv, S, D_v\) must agree but in the last "
         r"dimension, got \(1, 2, 5, 4\) and \(1, 2, 6, 4\)"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 5, 8), _arr(1, 2, 5, 8), {}, ValueError,
         r"q and k must share the head dim D; q \(1, 2, 2, 4\), k \(1, 2, 5, 8\)"),
        (_arr(2, 2, 2, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4), {}, ValueError,
         r"k \(B.., H_kv, S, D\) must have q's batch dimensions"),
        (_arr(2, 4), _arr(2, 4), _arr(2, 4), {}, ValueError,
         r"q must have at least 3 dimensions, got \(2, 4\)"),
        (_arr(1, 2, 6, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4), {"mask": "causal"}, ValueError,
         r"a causal mask .* needs L <= S, got L=6 queries \(q \(1, 2, 6, 4\)\) and S=5"),
        (_arr(1, 2, 6, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4), {"window": 2}, ValueError,
         r"needs L <= S"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4), {"window": 0}, ValueError,
         r"scaled_dot_product_attention: window must be an int >= 1 or None, got 0"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4),
         {"mask": np.ones((3, 5), bool)}, ValueError,
         r"mask of shape \(3, 5\) does not broadcast to the scores \(B.., H, L, S\) = "
         r"\(1, 2, 2, 5\)"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4),
         {"mask": np.ones((2, 1, 2, 2, 5), bool)}, ValueError, r"does not broadcast"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4),
         {"mask": np.ones((2, 5), np.int32)}, TypeError, r"mask must be 'causal', a boolean"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4), {"mask": "full"}, ValueError,
         r"mask must be None, 'causal' or an array, got 'full'"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4), {"softcap": 0.0}, ValueError,
         r"softcap must be a positive finite number"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4), {"scale": float("nan")},
         ValueError, r"scale must be a finite number"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4), {"block_size": 0}, ValueError,
         r"block_size must be an int >= 1"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 5, 4), _arr(1, 2, 5, 4), {"impl": "flash"}, ValueError,
         r"impl must be one of \('auto', 'portable', 'native', 'tiled'\)"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 5, 4, dtype="float64"), _arr(1, 2, 5, 4), {}, TypeError,
         r"arrays must share one dtype"),
        (_arr(1, 2, 2, 4), _arr(1, 2, 0, 4), _arr(1, 2, 0, 4), {}, ValueError, r"no keys"),
    ],
)  # fmt: skip
def test_bad_input(q, k, v, kwargs, error, match):
    with pytest.raises(error, match=match):
        pl.scaled_dot_product_attention(q, k, v, **kwargs)


def test_native_impl_on_a_backend_without_one():
    q = _arr(1, 2, 2, 4)
    with pytest.raises(ValueError, match="backend 'numpy' has no native kernel"):
        pl.scaled_dot_product_attention(q, q, q, impl="native")


# -- the attention block ---------------------------------------------------------------------

# (B, L, E, H, H_kv, D): GQA with D = E / H; MQA with an explicit D != E / H (as Qwen3); decode.
BLOCK_SHAPES = [(2, 5, 16, 4, 2, 4), (1, 3, 12, 3, 1, 8), (1, 1, 8, 2, 2, 4)]
ROPES = [None, {}, {"base": 1e6}, {"base": 500.0, "traditional": True}, {"dims": 2}]


def block_inputs(
    seed: int, shape: tuple, dtype: str, backend: str, *, bias: bool, qk_norm: bool | str
):
    """The block's arrays (dict of backend arrays) and their float64 copies; ``qk_norm``:
    ``True`` norms each head, ``"whole"`` all heads' features (OLMo 2)."""
    b, L, E, h, h_kv, d = shape
    arrays = {
        "x": random_array(seed, (b, L, E), dtype, backend=backend),
        "wq": random_weight(seed + 1, (h * d, E), dtype, backend=backend),
        "wk": random_weight(seed + 2, (h_kv * d, E), dtype, backend=backend),
        "wv": random_weight(seed + 3, (h_kv * d, E), dtype, backend=backend),
        "wo": random_weight(seed + 4, (E, h * d), dtype, backend=backend),
    }
    if bias:
        for i, (name, n) in enumerate((("bq", h), ("bk", h_kv), ("bv", h_kv))):
            arrays[name] = random_array(seed + 5 + i, (n * d,), dtype, backend=backend, scale=0.3)
    if qk_norm:
        for i, (name, n) in enumerate((("q_norm", h), ("k_norm", h_kv))):
            size = n * d if qk_norm == "whole" else d
            arrays[name] = random_array(
                seed + 8 + i, (size,), dtype, backend=backend, low=0.5, high=1.5
            )
    ops = {k: a for k, (a, _) in arrays.items()}
    refs = {k: r for k, (_, r) in arrays.items()}
    return ops, refs


@given(
    impl=st.sampled_from(IMPLS),
    shape=st.sampled_from(BLOCK_SHAPES),
    rope=st.sampled_from(ROPES),
    bias=st.booleans(),
    qk_norm=st.sampled_from([False, True, "whole"]),
    mask=st.sampled_from(["causal", None, "window"]),
    offset=st.sampled_from([0, 7]),  # a static option of the compiled RoPE on JAX
    seed=seeds(),
)
def test_attention_block_matches_reference(
    backend, dtype, impl, shape, rope, bias, qk_norm, mask, offset, seed
):
    ops, refs = block_inputs(seed, shape, dtype, backend, bias=bias, qk_norm=qk_norm)
    h, h_kv, d = shape[3:]
    kw = {"window": 2} if mask == "window" else {"mask": mask}
    x = ops.pop("x")
    out = pl.attention(
        x, **ops, num_heads=h, num_kv_heads=h_kv, head_dim=d, rope=rope, offset=offset,
        norm_eps=1e-6, impl=impl, **kw,
    )  # fmt: skip
    expected = reference.attention(
        refs.pop("x"), **refs, num_heads=h, num_kv_heads=h_kv, head_dim=d, rope_options=rope,
        offset=offset, norm_eps=1e-6, **kw,
    )  # fmt: skip
    assert_close(out, expected, backend=backend, dtype=dtype)


def test_attention_block_per_sequence_offsets(backend):
    # An offset array (B,) equals running each sequence with its own int offset.
    shape = BLOCK_SHAPES[0]
    ops, _ = block_inputs(0, shape, "float32", backend, bias=True, qk_norm=True)
    x, (h, h_kv, d) = ops.pop("x"), shape[3:]
    offsets = pl.asarray(np.array([3, 11]), backend=backend)
    both = pl.to_numpy(
        pl.attention(x, **ops, num_heads=h, num_kv_heads=h_kv, head_dim=d, offset=offsets)
    )
    x_np = pl.to_numpy(x)
    for i, off in enumerate((3, 11)):
        xi = pl.asarray(x_np[i : i + 1], backend=backend)
        one = pl.attention(xi, **ops, num_heads=h, num_kv_heads=h_kv, head_dim=d, offset=off)
        assert_close(pl.to_numpy(one), both[i : i + 1])


@given(seed=seeds(), cut=st.integers(0, 4))
def test_attention_block_is_causal(backend, seed, cut):
    shape = BLOCK_SHAPES[0]  # L = 5
    ops, refs = block_inputs(seed, shape, "float32", backend, bias=False, qk_norm=False)
    x, h, h_kv, d = ops.pop("x"), shape[3], shape[4], shape[5]
    x2 = refs["x"].copy()
    x2[:, cut + 1 :] = np.random.default_rng(seed).uniform(-3, 3, x2[:, cut + 1 :].shape)
    x2 = pl.asarray(x2, backend=backend, dtype="float32")
    kw = dict(num_heads=h, num_kv_heads=h_kv, head_dim=d)
    before = pl.to_numpy(pl.attention(x, **ops, **kw))[:, : cut + 1]
    after = pl.to_numpy(pl.attention(x2, **ops, **kw))[:, : cut + 1]
    assert_close(after, before)


def test_attention_block_tiled_equals_portable(backend):
    shape = (1, 40, 16, 4, 2, 4)
    ops, _ = block_inputs(1, shape, "float32", backend, bias=True, qk_norm=False)
    x, kw = ops.pop("x"), dict(num_heads=4, num_kv_heads=2, rope={"base": 1e4})
    tiled = pl.attention(x, **ops, **kw, impl="tiled", block_size=16)
    assert_close(tiled, pl.attention(x, **ops, **kw, impl="portable"))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"num_kv_heads": 3}, ValueError, r"num_heads=4 must be a multiple of num_kv_heads=3"),
        ({"num_heads": 0}, ValueError, r"attention: num_heads must be an int >= 1, got 0"),
        ({"head_dim": None, "num_heads": 3, "num_kv_heads": 1}, ValueError,
         r"hidden size E=16 \(x \(2, 5, 16\)\) is not a multiple of num_heads=3"),
        ({"wq": np.zeros((12, 16), np.float32)}, ValueError,
         r"attention: wq must have shape \(16, 16\) \(4 heads x head_dim 4, E\), got \(12, 16\)"),
        ({"wk": np.zeros((8, 15), np.float32)}, ValueError, r"wk must have shape \(O, 16\)"),
        ({"wo": np.zeros((16, 8), np.float32)}, ValueError,
         r"wo must have shape \(E_out, 16\) \(H \* D = 4 x 4\), got \(16, 8\)"),
        ({"q_norm": np.ones(5, np.float32)}, ValueError,
         r"q_norm must have shape \(4,\) \(each head's head_dim features\) or \(16,\) "
         r"\(all 4 heads' features, as OLMo 2\), q_norm and k_norm alike; got \(5,\)"),
        ({"q_norm": np.ones(16, np.float32), "k_norm": np.ones(4, np.float32)}, ValueError,
         r"k_norm must have shape \(4,\) .* or \(8,\) .*; got \(4,\)"),
        ({"rope": {"theta": 1e6}}, ValueError, r"unknown rope option\(s\) 'theta'; known: base"),
        ({"x": np.zeros((5, 16), np.float32)}, ValueError, r"x must have shape \(B, L, E\)"),
        ({"impl": "flash"}, ValueError, r"attention: impl must be one of"),
        ({"norm_eps": -1.0}, ValueError, r"attention: norm_eps must be >= 0"),
        ({"window": 0}, ValueError, r"attention: window must be an int >= 1"),
        ({"mask": np.ones((3, 5), bool)}, ValueError, r"attention: mask of shape \(3, 5\)"),
        # A float64 weight with float32 x is cast (the mixed-precision rule, tested in
        # test_attention_edges.py); a non-float weight stays an error.
        ({"wv": np.zeros((8, 16), np.int32)}, TypeError, r"attention: wv must have a float dtype"),
    ],
)  # fmt: skip
def test_attention_block_bad_input(change, error, match):
    ops, _ = block_inputs(0, BLOCK_SHAPES[0], "float32", "numpy", bias=False, qk_norm=False)
    kwargs = {**ops, "num_heads": 4, "num_kv_heads": 2, "head_dim": 4, **change}
    x = kwargs.pop("x")
    with pytest.raises(error, match=match):
        pl.attention(x, **kwargs)
