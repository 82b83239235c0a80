"""gpt-oss's mixture of experts in :func:`pl.moe`: the router's bias, the experts' biases and
MXFP4 experts kept quantized, on every ``moe_experts`` kernel.

Values against the float64 reference (``reference.moe`` with ``router_bias`` and
``experts_biases``); MXFP4 experts against the same call over their float64 dequantization
(``reference.mxfp4_dequantize``, which decodes the E2M1 fields from the bits) and against
``dequantize`` then ``moe`` (the baseline the kernel keeps); the properties that a router bias
equal for every expert changes nothing (softmax is shift-invariant) and that a bias far above
the logits routes every token to its expert; bad input.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.core.dispatch import dispatcher
from portable_llm.ops.moe_experts import MOE_MXFP4
from portable_llm.testing import assert_close, random_array, random_weight, reference, tolerance
from portable_llm.testing.strategies import seeds

X, E, INTER = 4, 64, 32  # experts, hidden size, expert width: whole MXFP4 blocks of 32
SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}  # gpt-oss's


def _inputs(seed: int, dtype: str, backend: str, L: int = 3) -> tuple[list, list]:
    """x ``(2, L, E)``, the router, the experts; then the router's and experts' biases."""
    shapes_ = [(2, L, E), (X, E), (X, INTER, E), (X, INTER, E), (X, E, INTER),
               (X,), (X, INTER), (X, INTER), (X, E)]  # fmt: skip
    pairs = [
        (random_array if j in (0, 5) else random_weight)(seed + j, s, dtype, backend=backend)
        for j, s in enumerate(shapes_)
    ]
    return [a for a, _ in pairs], [r for _, r in pairs]


def _kw(arrays: list) -> dict:
    return {"router_bias": arrays[5], "experts_gate_bias": arrays[6],
            "experts_up_bias": arrays[7], "experts_down_bias": arrays[8]}  # fmt: skip


def _skip_without_native(op: str, backend: str, x) -> None:
    nat = dispatcher(pl.get_backend(backend)).native.get(op)
    if nat is None or (nat.applies is not None and not nat.applies(x)):
        pytest.skip(f"{backend} has no {op} kernel for {x.dtype} here")


# JAX compiles per dtype and option set: its half and float64 runs go to tox -e slow (issue 34)
@pytest.mark.slow_on("jax", dtypes=("float16", "bfloat16", "float64"))
@pytest.mark.parametrize("impl", ["auto", "portable", "dense", "native"])
def test_moe_with_biases_matches_reference(backend, dtype, impl):
    arrays, refs = _inputs(0, dtype, backend)
    if impl == "native":
        _skip_without_native("moe_experts", backend, arrays[0])
    out = pl.moe(*arrays[:5], top_k=2, norm_topk_prob=True, **SWIGLU, **_kw(arrays), impl=impl)
    want = reference.moe(
        *refs[:5], top_k=2, norm_topk_prob=True, swiglu=(7.0, 1.702), router_bias=refs[5],
        experts_biases=tuple(refs[6:]),
    )  # fmt: skip
    assert_close(out, want, backend=backend, dtype=dtype)


def test_route_with_a_bias_matches_reference(backend, dtype):
    arrays, refs = _inputs(1, dtype, backend)
    weights, ids = pl.route(arrays[0], arrays[1], top_k=2, norm_topk_prob=True,
                            router_bias=arrays[5])  # fmt: skip
    want_w, want_ids = reference.route(refs[0], refs[1], top_k=2, norm_topk_prob=True,
                                       router_bias=refs[5])  # fmt: skip
    # the same experts; two of near-equal weight may swap places in half precision
    got_ids = pl.to_numpy(ids)
    np.testing.assert_array_equal(np.sort(got_ids, axis=-1), np.sort(want_ids, axis=-1))
    by_id, want_by_id = np.argsort(got_ids, axis=-1), np.argsort(want_ids, axis=-1)
    tol = tolerance(dtype, backend)  # the logits are rounded to x's dtype
    assert_close(
        np.take_along_axis(pl.to_numpy(weights), by_id, axis=-1),
        np.take_along_axis(want_w, want_by_id, axis=-1), rtol=tol.rtol, atol=tol.atol,
        dtype="float64" if dtype == "float64" else "float32",
    )  # fmt: skip


@given(seed=seeds(), shift=st.floats(-30.0, 30.0))
def test_an_equal_router_bias_changes_nothing(backend, seed, shift):
    arrays, _ = _inputs(seed, "float64", backend)
    flat = pl.asarray(np.full((X,), shift), backend=backend)
    kw = {"top_k": 2, "norm_topk_prob": True, **SWIGLU}
    assert_close(pl.moe(*arrays[:5], **kw, router_bias=flat), pl.moe(*arrays[:5], **kw),
                 backend=backend, dtype="float64")  # fmt: skip


@given(seed=seeds(), expert=st.integers(0, X - 1))
def test_a_dominant_router_bias_routes_every_token_to_its_expert(backend, seed, expert):
    arrays, _ = _inputs(seed, "float64", backend)
    bias = np.zeros((X,))
    bias[expert] = 1e3  # far above any logit of these inputs
    _, ids = pl.route(arrays[0], arrays[1], top_k=2, router_bias=pl.asarray(bias, backend=backend))
    assert (pl.to_numpy(ids)[..., 0] == expert).all()


@given(seed=seeds())
def test_one_biased_expert_is_the_biased_clamped_mlp(backend, seed):
    """One expert, top-1: its weight is 1 whatever the router (and its bias) says, so the block
    is ``pl.mlp`` with the expert's biases and the clamped SwiGLU."""
    arrays, _ = _inputs(seed, "float64", backend)
    x, w, g, u, d, rb, bg, bu, bd = arrays
    one = [a[0:1, ...] for a in (w, g, u, d, rb, bg, bu, bd)]
    out = pl.moe(x, *one[:4], top_k=1, router_bias=one[4], experts_gate_bias=one[5],
                 experts_up_bias=one[6], experts_down_bias=one[7], **SWIGLU)  # fmt: skip
    g0, u0, d0, bg0, bu0, bd0 = (a[0, ...] for a in (g, u, d, bg, bu, bd))
    dense = pl.mlp(x, g0, u0, d0, b_gate=bg0, b_up=bu0, b_down=bd0, **SWIGLU)
    assert_close(out, dense, backend=backend, dtype="float64")


# -- MXFP4 experts --------------------------------------------------------------------------


def _mxfp4(seed: int, shape: tuple[int, ...], backend: str) -> tuple[pl.MXFP4Weight, np.ndarray]:
    """Random MXFP4 codes, scales 2**-7 .. 2**-5 (weights up to 0.19, as a fan-in of 64 wants:
    O(1) outputs) and their float64 values."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, shape).astype(np.uint32)  # (.., N, K)
    packed = (codes.reshape(*shape[:-1], -1, 8) << (4 * np.arange(8, dtype=np.uint32))).sum(
        -1, dtype=np.uint32
    )  # (.., N, K / 8)
    scales = rng.integers(120, 123, (*shape[:-1], shape[-1] // 32)).astype(np.uint8)
    w = pl.MXFP4Weight(pl.asarray(packed, backend=backend), pl.asarray(scales, backend=backend))
    return w, reference.mxfp4_dequantize(packed, scales)


def _mxfp4_experts(seed: int, backend: str) -> tuple[list, list]:
    shapes_ = [(X, INTER, E), (X, INTER, E), (X, E, INTER)]
    pairs = [_mxfp4(seed + j, s, backend) for j, s in enumerate(shapes_)]
    return [w for w, _ in pairs], [r for _, r in pairs]


@pytest.mark.slow_on("jax", dtypes=("float16", "bfloat16", "float64"))
@pytest.mark.parametrize("impl", ["auto", "portable", "dense", "native"])
def test_moe_over_mxfp4_experts_matches_reference(backend, dtype, impl):
    arrays, refs = _inputs(2, dtype, backend)
    if impl == "native":  # MLX: mx.gather_qmm(mode="mxfp4")
        _skip_without_native(MOE_MXFP4, backend, arrays[0])
    experts, experts_r = _mxfp4_experts(20, backend)
    out = pl.moe(arrays[0], arrays[1], *experts, top_k=2, norm_topk_prob=True, **SWIGLU,
                 **_kw(arrays), impl=impl)  # fmt: skip
    want = reference.moe(
        refs[0], refs[1], *experts_r, top_k=2, norm_topk_prob=True, swiglu=(7.0, 1.702),
        router_bias=refs[5], experts_biases=tuple(refs[6:]),
    )  # fmt: skip
    assert_close(out, want, backend=backend, dtype=dtype)


def test_mxfp4_experts_equal_their_dequantized_floats(backend):
    """The kept-quantized kernel against the baseline: ``dequantize`` each expert stack, then
    the float ``moe`` (float32: the weights are exact, only the sums' order may differ)."""
    arrays, _ = _inputs(3, "float32", backend)
    experts, _ = _mxfp4_experts(30, backend)
    kw = {"top_k": 2, "norm_topk_prob": True, **SWIGLU, **_kw(arrays)}
    floats = [pl.dequantize(w) for w in experts]
    assert_close(pl.moe(arrays[0], arrays[1], *experts, **kw),
                 pl.moe(arrays[0], arrays[1], *floats, **kw), backend=backend)  # fmt: skip


def test_mxfp4_experts_stay_quantized(backend):
    """Only the MXFP4 kernels run: a trace of the call names ``moe_experts_mxfp4`` and the
    MXFP4 product, never the float ``moe_experts`` nor a dequantize of the whole stack."""
    arrays, _ = _inputs(4, "float32", backend)
    experts, _ = _mxfp4_experts(40, backend)
    with pl.trace() as t:
        pl.moe(arrays[0], arrays[1], *experts, top_k=2, **SWIGLU, impl="portable")
    ops = {entry.op for entry in t}
    assert MOE_MXFP4 in ops and "quantized_linear_mxfp4" in ops
    assert "moe_experts" not in ops and "dequantize_mxfp4" not in ops


def test_mxfp4_experts_under_jax_jit(backend):
    """Traced (a compiled decode step): the codes are dequantized inside the program and run
    by the float kernel (``ragged_dot``), equal to the eager call."""
    if backend != "jax":
        pytest.skip("jax.jit is JAX's")
    import jax

    arrays, _ = _inputs(5, "float32", backend)
    experts, _ = _mxfp4_experts(50, backend)
    kw = {"top_k": 2, "norm_topk_prob": True, **SWIGLU, **_kw(arrays)}
    step = jax.jit(lambda x: pl.moe(x, arrays[1], *experts, **kw))
    assert_close(step(arrays[0]), pl.moe(arrays[0], arrays[1], *experts, **kw), backend=backend)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"router_bias": np.zeros((X + 1,))}, ValueError,
         r"moe: router_bias must have shape \(4,\) \(one logit per expert of w_router \(4, 64\)\)"
         r", got \(5,\)"),
        ({"experts_down_bias": np.zeros((X, INTER))}, ValueError,
         r"moe: experts_down_bias must have shape \(4, 64\) to match experts_gate \(4, 32, 64\)"),
        ({"experts_up_bias": None}, ValueError,
         r"moe: the experts' biases come as three or none; experts_up_bias missing"),
        ({"router": "grouped"}, ValueError, r"moe: router_bias is added to the logits of"),
        ({"router_bias": np.zeros((X,), np.int32)}, TypeError, r"moe: router_bias must have a"),
    ],
)  # fmt: skip
def test_bad_biases(change, error, match):
    arrays, _ = _inputs(6, "float64", "numpy")
    kw = {"top_k": 2, **_kw(arrays), **change}
    with pytest.raises(error, match=match):
        pl.moe(*arrays[:5], **kw)


def test_mixed_mxfp4_and_float_experts_are_refused():
    arrays, _ = _inputs(7, "float32", "numpy")
    experts, _ = _mxfp4_experts(70, "numpy")
    with pytest.raises(TypeError, match=r"must all be MXFP4Weight or none; got MXFP4Weight, "):
        pl.moe(arrays[0], arrays[1], experts[0], arrays[3], arrays[4], top_k=2)
    with pytest.raises(ValueError, match=r"experts_down must have shape \(4, 64, 32\)"):
        pl.moe(arrays[0], arrays[1], experts[0], experts[1], experts[0], top_k=2)
