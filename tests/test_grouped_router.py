"""route/moe(router="grouped"): DeepSeek V3's group-limited top-k with a correction bias.

Values against the float64 reference (``reference.grouped_route``: a loop over tokens with
Python sorts), properties (one group and no bias is the sigmoid top-k; the experts chosen lie
in at most ``topk_group`` groups; the bias moves the selection, never the weights' values;
``norm_topk_prob`` sums to ``routed_scaling_factor``), the MoE block, bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.testing import assert_close, random_array, random_weight, reference, tolerance
from portable_llm.testing.strategies import seeds

X, E, INTER = 8, 8, 6  # experts, hidden size, expert width: one set of sizes (JAX compiles per
# shape)
TOKENS = st.sampled_from([(1,), (2, 3)])
# (n_group, topk_group, top_k): groups of 2 keeping 2 of 4, groups of 4 keeping 1 of 2, one group
GROUPINGS = st.sampled_from([(4, 2, 3), (2, 1, 2), (1, 1, 2)])


def _inputs(seed: int, dtype: str, backend: str, tokens: tuple, bias: bool) -> tuple[list, list]:
    """x, w_router, e_score_correction_bias (or None) on the backend, and their float64 copies."""
    x = random_array(seed, (*tokens, E), dtype, backend=backend)
    w = random_weight(seed + 1, (X, E), dtype, backend=backend)
    b = random_array(seed + 2, (X,), "float32", backend=backend, low=-0.3, high=0.3)
    pairs = [x, w, b if bias else (None, None)]
    return [a for a, _ in pairs], [r for _, r in pairs]


def _separated(refs: list, n_group: int, topk_group: int, top_k: int) -> bool:
    """No near-tie in float32 at a group or expert boundary: the float64 reference then picks
    what float32 picks."""
    x, w, b = refs
    biased = 1.0 / (1.0 + np.exp(-reference.linear(x, w))) + (0.0 if b is None else b)
    groups = np.sort(biased.reshape(*biased.shape[:-1], n_group, -1), axis=-1)[..., -2:].sum(-1)
    gaps = [np.diff(np.sort(a, axis=-1), axis=-1) for a in (groups, biased) if a.shape[-1] > 1]
    return all(bool((np.abs(g) > 1e-5).all()) for g in gaps)


def _route(arrays: list, grouping: tuple, *, norm: bool = False, scale: float = 1.0, **kw):
    n_group, topk_group, top_k = grouping
    x, w, b = arrays
    return pl.route(
        x, w, top_k=top_k, router="grouped", n_group=n_group, topk_group=topk_group,
        e_score_correction_bias=b, norm_topk_prob=norm, routed_scaling_factor=scale, **kw,
    )  # fmt: skip


def _compute(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


@given(tokens=TOKENS, grouping=GROUPINGS, norm=st.booleans(), bias=st.booleans(), seed=seeds())
def test_grouped_route_matches_reference(backend, dtype, tokens, grouping, norm, bias, seed):
    arrays, refs = _inputs(seed, dtype, backend, tokens, bias)
    assume(_separated(refs, *grouping))
    weights, ids = _route(arrays, grouping, norm=norm, scale=2.5)
    n_group, topk_group, top_k = grouping
    want_w, want_ids = reference.route(
        refs[0], refs[1], top_k=top_k, norm_topk_prob=norm, router="grouped", n_group=n_group,
        topk_group=topk_group, e_score_correction_bias=refs[2], routed_scaling_factor=2.5,
    )  # fmt: skip
    np.testing.assert_array_equal(pl.to_numpy(ids), want_ids)
    # Computed in float32 from the (rounded) inputs, as HF's router: float32's tolerance.
    tol = tolerance(_compute(dtype), backend)
    assert_close(
        weights, want_w, rtol=tol.rtol, atol=tol.atol, backend=backend, dtype=_compute(dtype)
    )


@given(tokens=TOKENS, top_k=st.sampled_from([1, 3]), seed=seeds())
def test_one_group_without_bias_is_the_sigmoid_top_k(backend, tokens, top_k, seed):
    arrays, _ = _inputs(seed, "float32", backend, tokens, bias=False)
    grouped = _route(arrays, (1, 1, top_k))
    plain = pl.route(arrays[0], arrays[1], top_k=top_k, router="sigmoid")
    np.testing.assert_array_equal(pl.to_numpy(grouped[1]), pl.to_numpy(plain[1]))
    assert_close(grouped[0], plain[0])


@given(tokens=TOKENS, grouping=GROUPINGS, bias=st.booleans(), seed=seeds())
def test_the_experts_chosen_lie_in_at_most_topk_group_groups(backend, tokens, grouping, bias, seed):
    arrays, _ = _inputs(seed, "float32", backend, tokens, bias)
    n_group, topk_group, top_k = grouping
    ids = pl.to_numpy(_route(arrays, grouping)[1]).reshape(-1, top_k)
    for row in ids:
        assert len(set(row.tolist())) == top_k  # k distinct experts
        assert len({e // (X // n_group) for e in row.tolist()}) <= topk_group


@given(tokens=TOKENS, grouping=GROUPINGS, seed=seeds())
def test_the_bias_moves_the_selection_not_the_weights(backend, tokens, grouping, seed):
    # A bias that favours experts 5..7 strongly: they are chosen first, and each weight is still
    # the unbiased sigmoid of that expert's logit (read from the unbiased route over all X).
    arrays, _ = _inputs(seed, "float32", backend, tokens, bias=False)
    b = np.zeros(X, np.float32)
    b[5:] = 10.0
    arrays[2] = pl.asarray(b, backend=backend)
    weights, ids = (pl.to_numpy(a) for a in _route(arrays, grouping))
    assert set(ids.reshape(-1).tolist()) <= {5, 6, 7}  # top_k <= 3; their groups win too
    arrays[2] = None
    all_w, all_ids = (pl.to_numpy(a) for a in _route(arrays, (1, 1, X)))
    scores = np.take_along_axis(all_w, np.argsort(all_ids, axis=-1), axis=-1)  # by expert id
    assert_close(weights, np.take_along_axis(scores, ids, axis=-1))


def test_norm_topk_prob_sums_to_the_scaling_factor(backend):
    arrays, _ = _inputs(3, "float32", backend, (2, 3), bias=True)
    weights, _ = _route(arrays, (4, 2, 3), norm=True, scale=2.5)
    assert_close(pl.to_numpy(weights).sum(axis=-1), np.full((2, 3), 2.5, np.float32))
    assert pl.to_numpy(weights).dtype == np.float32


@pytest.mark.parametrize("impl", ["auto", "portable", "dense"])
def test_moe_with_the_grouped_router_matches_reference(backend, dtype, impl):
    arrays, refs = _inputs(4, dtype, backend, (2, 3), bias=True)
    assert _separated(refs, 4, 2, 3)  # this seed's choices are the same in float32 and 64
    experts = [
        random_weight(10 + j, shape, dtype, backend=backend)
        for j, shape in enumerate([(X, INTER, E), (X, INTER, E), (X, E, INTER)])
    ]
    shared = [
        random_weight(20 + j, shape, dtype, backend=backend)
        for j, shape in enumerate([(4, E), (4, E), (E, 4)])
    ]
    grouped = {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}
    out = pl.moe(
        arrays[0], arrays[1], *(a for a, _ in experts), top_k=3, norm_topk_prob=True,
        router="grouped", e_score_correction_bias=arrays[2], shared=tuple(a for a, _ in shared),
        impl=impl, **grouped,
    )  # fmt: skip
    want = reference.moe(
        refs[0], refs[1], *(r for _, r in experts), top_k=3, norm_topk_prob=True,
        router="grouped", e_score_correction_bias=refs[2], shared=tuple(r for _, r in shared),
        **grouped,
    )  # fmt: skip
    assert_close(out, want, backend=backend, dtype=dtype)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"n_group": 3}, ValueError, r"route: n_group=3 must divide the number of experts X=8"),
        ({"topk_group": 5}, ValueError, r"route: topk_group must be"),
        ({"n_group": 0}, ValueError, r"route: n_group must be"),
        ({"top_k": 5}, ValueError,
         r"route: top_k=5 experts cannot come from topk_group=2 groups of 2 \(X=8, n_group=4\)"),
        ({"n_group": 8, "topk_group": 2, "top_k": 2}, ValueError,
         r"the sum of its top 2 experts: n_group=8 leaves 1 expert per group"),
        ({"e_score_correction_bias": np.zeros(4, np.float32)}, ValueError,
         r"route: e_score_correction_bias must have shape \(8,\) \(one per expert\), got \(4,\)"),
        ({"e_score_correction_bias": np.zeros(8, np.int32)}, TypeError,
         r"route: e_score_correction_bias must have a float dtype"),
        ({"routed_scaling_factor": 0.0}, ValueError, r"route: routed_scaling_factor must be"),
        ({"routed_scaling_factor": "2"}, TypeError, r"route: routed_scaling_factor must be a real"),
        ({"router": "softmax"}, ValueError,
         r"route: n_group is an option of router='grouped', not 'softmax'"),
        ({"router": "sigmoid", "n_group": 1, "topk_group": 1}, ValueError,
         r"route: e_score_correction_bias is an option of router='grouped', not 'sigmoid'"),
    ],
)  # fmt: skip
def test_grouped_route_rejects_bad_input(change, error, match):
    x = np.zeros((3, E), np.float32)
    kw = {"top_k": 3, "router": "grouped", "n_group": 4, "topk_group": 2,
          "e_score_correction_bias": np.zeros(X, np.float32), **change}  # fmt: skip
    with pytest.raises(error, match=match):
        pl.route(x, np.zeros((X, E), np.float32), **kw)


def test_quantized_experts_keep_the_grouped_and_swiglu_options(backend):
    # moe dequantizes quantized experts and calls itself: every option of the new routers and
    # the clamped SwiGLU must reach that call (the same result as the dequantized weights).
    arrays, _ = _inputs(5, "float32", backend, (2, 3), bias=True)
    gate, up = (random_weight(30 + j, (X, 16, E), "float32", backend=backend)[0] for j in (0, 1))
    down = random_weight(32, (X, E, 16), "float32", backend=backend)[0]
    quantized = [gate, up, pl.quantize(down, bits=8, group_size=16)]  # one quantized: enough
    kw = {"top_k": 3, "router": "grouped", "n_group": 4, "topk_group": 2,
          "e_score_correction_bias": arrays[2], "routed_scaling_factor": 2.5,
          "norm_topk_prob": True, "swiglu_limit": 0.5, "swiglu_alpha": 1.2}  # fmt: skip
    got = pl.moe(arrays[0], arrays[1], *quantized, **kw)
    want = pl.moe(arrays[0], arrays[1], gate, up, pl.dequantize(quantized[2]), **kw)
    assert_close(got, want, backend=backend)
