"""route and moe: the float64 reference, the dense equivalences, ties, the impls, bad input."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import portable_llm as pl
from portable_llm.backends import backend_of
from portable_llm.core.dispatch import dispatcher
from portable_llm.testing import assert_close, random_array, random_weight, reference, tolerance
from portable_llm.testing.strategies import seeds

moe_module = importlib.import_module("portable_llm.ops.moe")  # pl.moe is the function
experts_module = importlib.import_module("portable_llm.ops.moe_experts")  # its kernels

X, INTER, E, INTER_SHARED = 4, 12, 8, 6  # X experts, I, E, the shared I; one set of sizes:
# JAX compiles each op once per shape.
TOKENS = st.sampled_from([(1,), (2, 3)])
TOP_K = st.sampled_from([1, 2, X])
#: The MoE identities' float64 runs on JAX are slow there (``tox -e slow``): each compiles every
#: expert path anew, as float32 does, and the float32 run already checks JAX's adapter and
#: tracing; every other backend's env runs float64 in full, and JAX's float64 still runs the
#: route and MoE references (test_route_matches_reference, test_unused_experts_are_skipped).
JAX_FLOAT64_SLOW = pytest.mark.slow_on("jax", dtypes=("float64",))


@dataclass
class Inputs:
    arrays: dict[str, Any]
    refs: dict[str, Any]

    def call(self, top_k: int, norm: bool, shared: bool, **options: Any) -> Any:
        a = self.arrays
        extra = {"shared": a["shared"], "shared_gate": a["shared_gate"]} if shared else {}
        return pl.moe(a["x"], a["w_router"], a["gate"], a["up"], a["down"], top_k=top_k,
                      norm_topk_prob=norm, **extra, **options)  # fmt: skip

    def reference(self, top_k: int, norm: bool, shared: bool) -> np.ndarray:
        r = self.refs
        extra = {"shared": r["shared"], "shared_gate": r["shared_gate"]} if shared else {}
        return reference.moe(r["x"], r["w_router"], r["gate"], r["up"], r["down"], top_k=top_k,
                             norm_topk_prob=norm, **extra)  # fmt: skip


def _separated(x_r: np.ndarray, w_r: np.ndarray, top_k: int, dtype: str) -> bool:
    """No token's k-th and (k+1)-th router logits lie within the rounding of dtype: the choice of
    experts is then the same in float64 and in dtype."""
    if top_k == w_r.shape[0]:
        return True
    logits = -np.sort(-reference.linear(x_r, w_r), axis=-1)
    gap = logits[..., top_k - 1] - logits[..., top_k]
    return bool((gap > tolerance(dtype).rtol * np.abs(logits).max()).all())


def _inputs(seed: int, dtype: str, backend: str, tokens=(2, 3), top_k: int = 2, n_experts=X):
    """Random MoE weights (HF-like scale) whose routing has no near-tie at the top-k boundary."""
    for s in range(seed, seed + 1000 * 10, 10):
        x, x_r = random_array(s, (*tokens, E), dtype, backend=backend)
        w, w_r = random_weight(s + 1, (n_experts, E), dtype, backend=backend)
        if _separated(x_r, w_r, top_k, dtype):
            break
    arrays, refs = {"x": x, "w_router": w}, {"x": x_r, "w_router": w_r}
    shapes = {
        "gate": (n_experts, INTER, E), "up": (n_experts, INTER, E),
        "down": (n_experts, E, INTER), "s_gate": (INTER_SHARED, E), "s_up": (INTER_SHARED, E),
        "s_down": (E, INTER_SHARED), "shared_gate": (1, E),
    }  # fmt: skip
    for j, (name, shape) in enumerate(shapes.items()):
        arrays[name], refs[name] = random_weight(s + 2 + j, shape, dtype, backend=backend)
    for d in (arrays, refs):
        d["shared"] = (d.pop("s_gate"), d.pop("s_up"), d.pop("s_down"))
    return Inputs(arrays, refs)


def _float_out(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


# -- route -------------------------------------------------------------------------------------


@given(tokens=TOKENS, top_k=TOP_K, norm=st.booleans(), seed=seeds())
def test_route_matches_reference(backend, dtype, tokens, top_k, norm, seed):
    inp = _inputs(seed, dtype, backend, tokens, top_k)
    weights, ids = pl.route(inp.arrays["x"], inp.arrays["w_router"], top_k=top_k,
                            norm_topk_prob=norm)  # fmt: skip
    want_w, want_ids = reference.route(
        inp.refs["x"], inp.refs["w_router"], top_k=top_k, norm_topk_prob=norm
    )
    got_w = pl.to_numpy(weights)
    assert (np.diff(got_w, axis=-1) <= 0).all()  # descending
    # The same experts; within the k, two of near-equal weight may swap places in half precision.
    got_ids = pl.to_numpy(ids)
    by_id, want_by_id = np.argsort(got_ids, axis=-1), np.argsort(want_ids, axis=-1)
    np.testing.assert_array_equal(np.sort(got_ids, axis=-1), np.sort(want_ids, axis=-1))
    if dtype in ("float32", "float64"):
        np.testing.assert_array_equal(got_ids, want_ids)
    # The logits round to x's dtype (as HF's router), so the weights carry x's dtype's error.
    tol = tolerance(dtype, backend)
    assert_close(
        np.take_along_axis(got_w, by_id, axis=-1),
        np.take_along_axis(want_w, want_by_id, axis=-1),
        rtol=tol.rtol, atol=tol.atol, dtype=_float_out(dtype),
    )  # fmt: skip
    if norm:  # the k weights sum to 1
        assert_close(pl.to_numpy(weights).sum(axis=-1), np.ones(tokens), dtype=_float_out(dtype))


@pytest.mark.parametrize("impl", ["portable", "auto"])
def test_route_ties_go_to_the_lower_expert(backend, impl):
    x = pl.asarray(np.ones((1, E), np.float32), backend=backend)
    rows = np.array([0.0, 1.0, 0.5, 1.0, 1.0])[:, None] * np.ones((1, E), np.float32)
    w = pl.asarray(rows.astype(np.float32), backend=backend)  # experts 1, 3, 4 tie for first
    for k, want in [(1, [1]), (2, [1, 3]), (4, [1, 3, 4, 2])]:
        _, ids = pl.route(x, w, top_k=k, norm_topk_prob=False, impl=impl)
        np.testing.assert_array_equal(pl.to_numpy(ids)[0], want)


def test_native_top_k_equals_portable(backend):
    bk = pl.get_backend(backend)
    if "top_k" not in dispatcher(bk).native:
        pytest.skip(f"{backend} has no native top_k (torch.topk and mx.topk do not order ties)")
    ties = np.repeat(np.array([[0.0, 1.0, 0.5, 1.0, 1.0, 0.5]], np.float32), 3, axis=0)
    rand, _ = random_array(0, (3, 6), "float32", backend=backend)
    for probs in (pl.asarray(ties, backend=backend), rand):
        for k in (1, 3, 6):
            native = dispatcher(bk).native["top_k"].fn(bk.xp, probs, k=k)
            portable = moe_module._top_k(bk.xp, probs, k=k)
            np.testing.assert_array_equal(pl.to_numpy(native[1]), pl.to_numpy(portable[1]))
            assert_close(native[0], portable[0])


# -- moe against the reference and the dense equivalents ---------------------------------------


@pytest.mark.slow_on("jax")
@given(tokens=TOKENS, top_k=TOP_K, norm=st.booleans(), shared=st.booleans(),
       seed=seeds())  # fmt: skip
def test_moe_matches_reference(backend, dtype, tokens, top_k, norm, shared, seed):
    inp = _inputs(seed, dtype, backend, tokens, top_k)
    out = inp.call(top_k, norm, shared)
    assert_close(out, inp.reference(top_k, norm, shared), backend=backend, dtype=dtype)


@JAX_FLOAT64_SLOW
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_one_expert_top_1_is_the_dense_mlp(backend, dtype, act):
    inp = _inputs(0, dtype, backend, (2, 3), 1, n_experts=1)
    a = inp.arrays
    out = pl.moe(a["x"], a["w_router"], a["gate"], a["up"], a["down"], top_k=1,
                 norm_topk_prob=False, act=act)  # fmt: skip
    want = pl.mlp(a["x"], a["gate"][0, ...], a["up"][0, ...], a["down"][0, ...], act=act)
    assert_close(out, want)


@JAX_FLOAT64_SLOW
@pytest.mark.parametrize("norm", [True, False])
def test_all_experts_is_the_router_weighted_sum(backend, dtype, norm):
    # top_k = X keeps every expert; the weights are the full softmax (renormalising changes
    # nothing: they already sum to 1).
    inp = _inputs(1, dtype, backend, (2, 3), X)
    a, r = inp.arrays, inp.refs
    probs = reference.softmax(reference.linear(r["x"], r["w_router"]))  # (2, 3, X)
    want = sum(
        probs[..., e, None]
        * pl.to_numpy(pl.mlp(a["x"], a["gate"][e, ...], a["up"][e, ...], a["down"][e, ...])).astype(
            np.float64
        )
        for e in range(X)
    )
    assert_close(inp.call(X, norm, False), want, backend=backend, dtype=dtype)


@pytest.mark.slow_on("jax")
@given(tokens=TOKENS, top_k=TOP_K, seed=seeds(), perm=st.permutations(range(X)))
def test_moe_does_not_depend_on_the_order_of_the_experts(backend, dtype, tokens, top_k, seed,
                                                         perm):  # fmt: skip
    inp = _inputs(seed, dtype, backend, tokens, top_k)
    a = inp.arrays
    p = pl.asarray(np.array(perm), backend=backend)
    take = pl.get_backend(backend).xp.take
    permuted = [take(a[n], p, axis=0) for n in ("w_router", "gate", "up", "down")]
    out = pl.moe(a["x"], *permuted, top_k=top_k, norm_topk_prob=True)
    assert_close(out, inp.call(top_k, True, False))


def test_unused_experts_are_skipped(backend, dtype):
    # Experts 2 and 3 score -logit_0 (low wherever expert 0 is high): some experts get no token.
    for seed in range(2, 2000, 10):
        inp = _inputs(seed, dtype, backend, (5,), 1)
        r = inp.refs
        w_r = r["w_router"].copy()
        w_r[2:] = -w_r[0]
        ids = reference.route(r["x"], w_r, top_k=1, norm_topk_prob=False)[1]
        if _separated(r["x"], w_r, 1, dtype) and len(np.unique(ids)) < X:
            break
    w = pl.asarray(w_r, backend=backend, dtype=dtype)  # exact: -w is w's rounding negated
    a = inp.arrays
    out = pl.moe(a["x"], w, a["gate"], a["up"], a["down"], top_k=1, norm_topk_prob=False)
    want = reference.moe(r["x"], pl.to_numpy(w).astype(np.float64), r["gate"], r["up"],
                         r["down"], top_k=1, norm_topk_prob=False)  # fmt: skip
    assert_close(out, want, backend=backend, dtype=dtype)


@pytest.mark.parametrize("top_k", [1, 2, X])
def test_the_gather_runs_top_k_rows_per_token_not_x(backend, top_k, monkeypatch):
    rows = []
    real = experts_module._expert_mlp

    def counting(xp, xs, *args):
        rows.append(xs.shape[0])
        return real(xp, xs, *args)

    monkeypatch.setattr(experts_module, "_expert_mlp", counting)
    inp = _inputs(3, "float32", backend, (2, 3), top_k)
    gathered = inp.call(top_k, True, False, impl="portable")
    assert sum(rows) == 6 * top_k  # each token through its top_k experts only, not all X
    assert_close(gathered, inp.call(top_k, True, False, impl="dense"))


@JAX_FLOAT64_SLOW
@pytest.mark.parametrize("impl", ["auto", "dense", "native"])
@pytest.mark.parametrize("shared", [False, True])
def test_impls_equal_the_portable_gather(backend, dtype, impl, shared):
    bk = pl.get_backend(backend)
    inp = _inputs(4, dtype, backend, (2, 5), 2)
    if impl == "native":
        nat = dispatcher(bk).native.get("moe_experts")
        if nat is None:
            pytest.skip(f"{backend} has no native MoE kernel")
        if nat.applies is not None and not nat.applies(inp.arrays["x"]):
            pytest.skip(f"{nat.kernel} does not take {dtype} here")
    want = inp.call(2, False, shared, impl="portable")
    assert_close(inp.call(2, False, shared, impl=impl), want)


def test_no_tokens(backend):
    inp = _inputs(0, "float32", backend, (2, 3), 2)
    a = inp.arrays
    x = a["x"][:, :0, :]  # (2, 0, E)
    out = pl.moe(x, a["w_router"], a["gate"], a["up"], a["down"], top_k=2, norm_topk_prob=True)
    assert_close(out, np.zeros((2, 0, E), np.float32), backend=backend)


@JAX_FLOAT64_SLOW
def test_moe_under_jit(backend, dtype):
    if backend != "jax":
        pytest.skip("tracing (jax.jit) is JAX's")
    import jax

    inp = _inputs(5, dtype, "jax", (2, 3), 2)
    a = inp.arrays
    want = inp.call(2, True, True, impl="portable")
    for impl in ("auto", "native", "dense"):  # auto: jax.lax.ragged_dot
        f = jax.jit(lambda x, impl=impl: pl.moe(
            x, a["w_router"], a["gate"], a["up"], a["down"], top_k=2, norm_topk_prob=True,
            shared=a["shared"], shared_gate=a["shared_gate"], impl=impl))  # fmt: skip
        assert_close(f(a["x"]), want)
    with pytest.raises(ValueError, match="moe: impl='portable' reads the per-expert token"):
        jax.jit(lambda x: pl.moe(x, a["w_router"], a["gate"], a["up"], a["down"], top_k=2,
                                 norm_topk_prob=True, impl="portable"))(a["x"])  # fmt: skip


# -- bad input ---------------------------------------------------------------------------------


def _bad(name: str, a: dict) -> tuple[dict, dict]:
    """Arguments with one thing wrong, by name: (positional arrays, options)."""
    args = {k: a[k] for k in ("x", "w_router", "gate", "up", "down")}
    opts: dict = {"top_k": 2, "norm_topk_prob": True}
    xp = backend_of(a["x"]).xp
    if name in ("top_k_big", "top_k_zero"):
        opts["top_k"] = X + 1 if name == "top_k_big" else 0
    elif name == "w_router":
        args["w_router"] = a["w_router"][:, :3]
    elif name == "experts_gate":
        args["gate"] = a["gate"][:3, ...]
    elif name == "experts_up":
        args["up"] = a["up"][:, :5, :]
    elif name == "experts_down":
        args["down"] = xp.permute_dims(a["down"], (0, 2, 1))
    elif name == "shared_gate":
        opts.update(shared=a["shared"], shared_gate=a["shared_gate"][:, :3])
    elif name == "shared_gate_alone":
        opts["shared_gate"] = a["shared_gate"]
    return args, opts


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("top_k_big", r"moe: top_k must be in \[1, X\] = \[1, 4\]"),
        ("top_k_zero", r"moe: top_k must be in \[1, X\]"),
        ("w_router", r"moe: w_router must have shape \(X, 8\)"),
        ("experts_gate", r"moe: experts_gate must have shape \(4, I, 8\)"),
        ("experts_up", "moe: experts_up must have the shape of experts_gate"),
        ("experts_down", r"moe: experts_down must have shape \(4, 8, 12\)"),
        ("shared_gate", r"moe: shared_gate must have shape \(1, 8\)"),
        ("shared_gate_alone", "moe: shared_gate was given without a shared expert"),
    ],
)
def test_moe_rejects_bad_input(backend, name, match):
    inp = _inputs(0, "float32", backend, (3,), 2)
    args, opts = _bad(name, inp.arrays)
    with pytest.raises(ValueError, match=match):
        pl.moe(*args.values(), **opts)


def test_route_rejects_bad_input(backend):
    inp = _inputs(0, "float32", backend, (3,), 2)
    a = inp.arrays
    with pytest.raises(ValueError, match=r"route: top_k must be in \[1, X\] = \[1, 4\]"):
        pl.route(a["x"], a["w_router"], top_k=5, norm_topk_prob=True)
    with pytest.raises(TypeError, match="route: top_k must be an int"):
        pl.route(a["x"], a["w_router"], top_k=2.0, norm_topk_prob=True)
    with pytest.raises(TypeError, match="route: top_k must be an int, got bool True"):
        pl.route(a["x"], a["w_router"], top_k=True, norm_topk_prob=True)
    bk = pl.get_backend(backend)
    w_int = bk.astype(a["w_router"], bk.dtype("int32"))
    with pytest.raises(TypeError, match="route: w_router must have a float dtype"):
        pl.route(a["x"], w_int, top_k=2, norm_topk_prob=True)


def test_jax_auto_takes_ragged_dot_only_where_it_pays(backend):
    # XLA:CPU's ragged_dot is slower than the gather: eager CPU calls take the gather, traced
    # calls (which cannot run the gather) take ragged_dot; impl="native" always runs it.
    if backend != "jax":
        pytest.skip("ragged_dot is JAX's")
    import jax

    from portable_llm.core.dispatch import dispatcher, pick

    bk = pl.get_backend("jax")
    nat = dispatcher(bk).native["moe_experts"]
    inp = _inputs(6, "float32", "jax", (2, 3), 2)
    a = inp.arrays
    x = a["x"].reshape(-1, E)
    ids = jax.numpy.zeros((6, 2), dtype=jax.numpy.int32)
    args = (x, ids, ids, a["gate"], a["up"], a["down"])
    assert pick(bk, "moe_experts", "native", *args) is nat.fn
    on_cpu = jax.default_backend() == "cpu"
    eager = pick(bk, "moe_experts", "auto", *args)
    assert eager is (dispatcher(bk).portable_impl("moe_experts", "portable") if on_cpu else nat.fn)
    seen = []
    jax.jit(lambda x: seen.append(pick(bk, "moe_experts", "auto", x, *args[1:])) or x)(x)
    assert seen == [nat.fn]


# -- gradients: mx.grad through the router and the experts ------------------------------------


def _fd_grad(f, a: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """Central finite differences of the scalar f at a, in float64."""
    g = np.zeros_like(a)
    for i in np.ndindex(*a.shape):
        up, down = a.copy(), a.copy()
        up[i] += h
        down[i] -= h
        g[i] = (f(up) - f(down)) / (2 * h)
    return g


@pytest.mark.parametrize("impl", ["auto", "portable", "dense", "native"])
@pytest.mark.parametrize("shared", [False, True])
def test_mx_grad_of_moe_matches_finite_differences(backend, impl, shared):
    """mx.grad with respect to x, the router and the expert weights (the expert ids carry no
    gradient: MLX used to fail with "Cannot calculate VJP with respect to indices")."""
    if backend != "mlx":
        pytest.skip("mx.grad is MLX's")
    import mlx.core as mx

    inp = _inputs(5, "float32", backend, (3,), 2)
    a, r = inp.arrays, inp.refs
    c, c_r = random_array(99, (3, E), "float32", backend=backend)
    names = ["x", "w_router", "gate", "down"]
    extra = {"shared": a["shared"], "shared_gate": a["shared_gate"]} if shared else {}
    extra_r = {"shared": r["shared"], "shared_gate": r["shared_gate"]} if shared else {}

    def loss(x, w_router, gate, down):
        out = pl.moe(x, w_router, gate, a["up"], down, top_k=2, norm_topk_prob=False,
                     impl=impl, **extra)  # fmt: skip
        return mx.sum(out * c)

    grads = mx.grad(loss, argnums=(0, 1, 2, 3))(*(a[n] for n in names))
    for j, name in enumerate(names):

        def f(v, j=j):
            args = [r[n] for n in names]
            args[j] = v
            x, w_router, gate, down = args
            out = reference.moe(x, w_router, gate, r["up"], down, top_k=2,
                                norm_topk_prob=False, **extra_r)  # fmt: skip
            return float(np.sum(out * c_r))

        assert_close(grads[j], _fd_grad(f, r[name]), backend=backend, dtype="float32",
                     err_msg=f"d loss / d {name}")  # fmt: skip


def test_mx_grad_of_route_weights(backend):
    if backend != "mlx":
        pytest.skip("mx.grad is MLX's")
    import mlx.core as mx

    inp = _inputs(6, "float32", backend, (3,), 2)
    a, r = inp.arrays, inp.refs
    c, c_r = random_array(98, (3, 2), "float32", backend=backend)

    def loss(x, w):
        return mx.sum(pl.route(x, w, top_k=2, norm_topk_prob=False)[0] * c)

    gx, gw = mx.grad(loss, argnums=(0, 1))(a["x"], a["w_router"])

    def f_x(v):
        return float(
            np.sum(reference.route(v, r["w_router"], top_k=2, norm_topk_prob=False)[0] * c_r)
        )

    def f_w(v):
        return float(np.sum(reference.route(r["x"], v, top_k=2, norm_topk_prob=False)[0] * c_r))

    assert_close(gx, _fd_grad(f_x, r["x"]), backend=backend, dtype="float32")
    assert_close(gw, _fd_grad(f_w, r["w_router"]), backend=backend, dtype="float32")


def test_moe_weights_name_every_option_of_moe() -> None:
    """A decoder layer's ``MoeWeights`` carries each keyword option of ``pl.moe`` under the same
    name (an option added to the op but not to the record would never reach a model)."""
    import dataclasses
    import inspect

    from portable_llm.ops.moe import MoeWeights

    params = inspect.signature(pl.moe).parameters.values()
    options = [
        p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in ("impl", "backend")
    ]
    arrays = [p.name for p in params if p.kind is p.POSITIONAL_ONLY][1:]  # after x
    names = [f.name for f in dataclasses.fields(MoeWeights)]
    assert names == arrays + options
