"""Every native kernel of the foundation ops agrees with the portable path, per dtype.

impl="native" and impl="portable" run on the same inputs; the tolerance is the dtype's. The
kernels of later ops (rope, attention, ...) are checked in those ops' test files.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given

import portable_llm as pl
from conftest import only_on
from portable_llm.core.dispatch import dispatcher
from portable_llm.testing import assert_close, random_array, random_weight
from portable_llm.testing.strategies import seeds, shapes

UNARY = ["silu", "gelu", "gelu_tanh", "relu", "softmax"]


def _native_or_skip(backend: str, op: str) -> None:
    if op not in dispatcher(pl.get_backend(backend)).native:
        pytest.skip(f"{backend} has no native {op}")


@pytest.mark.parametrize("op", UNARY)
@given(shape=shapes(max_last=40), seed=seeds())
def test_unary_native_matches_portable(backend, dtype, op, shape, seed):
    _native_or_skip(backend, op)
    x, _ = random_array(seed, shape, dtype, backend=backend, low=-8, high=8)
    fn = getattr(pl, op)
    assert_close(fn(x, impl="native"), fn(x, impl="portable"))


@given(shape=shapes(max_last=64), seed=seeds())
def test_rms_norm_native_matches_portable(backend, dtype, shape, seed):
    _native_or_skip(backend, "rms_norm")
    x, _ = random_array(seed, shape, dtype, backend=backend)
    w, _ = random_array(seed + 1, shape[-1:], dtype, backend=backend, low=0.5, high=1.5)
    assert_close(
        pl.rms_norm(x, w, eps=1e-6, impl="native"), pl.rms_norm(x, w, eps=1e-6, impl="portable")
    )


@given(shape=shapes(max_last=48), seed=seeds())
def test_linear_native_matches_portable(backend, dtype, shape, seed):
    _native_or_skip(backend, "linear")
    x, _ = random_array(seed, shape, dtype, backend=backend)
    w, _ = random_weight(seed + 1, (17, shape[-1]), dtype, backend=backend)
    b, _ = random_array(seed + 2, (17,), dtype, backend=backend)
    assert_close(pl.linear(x, w, impl="native"), pl.linear(x, w, impl="portable"))
    assert_close(pl.linear(x, w, b, impl="native"), pl.linear(x, w, b, impl="portable"))


def test_auto_takes_the_native_kernel_where_it_is_preferred(backend, dtype):
    """auto runs the native kernel unless its applies/prefer predicate turns it down."""
    from portable_llm.core.dispatch import pick

    bk = pl.get_backend(backend)
    x, _ = random_array(0, (2, 8), dtype, backend=backend)
    w, _ = random_array(1, (8,), dtype, backend=backend)
    for op, args, opts in [("rms_norm", (x, w), {"eps": 1e-5}), ("softmax", (x,), {"axis": -1})]:
        nat = dispatcher(bk).native.get(op)
        chosen = pick(bk, op, "auto", *args, **opts)
        if nat is None:
            assert chosen is not None and chosen is pick(bk, op, "portable", *args, **opts)
        else:
            assert (chosen is nat.fn) == nat.auto(*args, **opts)


def test_torch_rms_norm_half_keeps_hf_rounding():
    """For half dtypes auto keeps HF's rounding order (portable), not F.rms_norm's."""
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.rand(64, dtype=torch.bfloat16) + 0.5
    hf = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert torch.equal(pl.rms_norm(x, w, eps=1e-6), hf)


@only_on("torch")
@pytest.mark.parametrize("shape", [(48,), (1, 48), (1, 1, 48), (3, 48), (2, 1, 48)])
def test_torch_float32_linear_one_row_and_gradients(shape):
    """float32 linear on torch's CPU: the public ``linear`` is F.linear bit for bit at any
    thread count (no NumPy detour); a model's ``model_linear`` runs NumPy's BLAS GEMV for one
    row of x at one torch thread, F.linear for more rows or threads; both within float32's
    tolerance of the float64 reference, and the gradient reaches x through autograd and
    through ``torch.func.grad`` (F.linear there)."""
    torch = pytest.importorskip("torch")
    from portable_llm.core.dispatch import pick

    bk = pl.get_backend("torch")
    x, x64 = random_array(0, shape, "float32", backend="torch")
    w, w64 = random_weight(1, (17, 48), "float32", backend="torch")
    b, b64 = random_array(2, (17,), "float32", backend="torch")
    model_linear = pick(bk, "model_linear", "auto", x, w, b)
    assert_close(pl.linear(x, w, b), x64 @ w64.T + b64, backend="torch", dtype="float32")
    threads = torch.get_num_threads()
    try:  # the branch taken: at one torch thread, NumPy's product bit for bit; else F.linear
        torch.set_num_threads(1)
        one_row = math.prod(shape[:-1]) == 1
        rows = x.numpy().reshape(-1, shape[-1])  # (M, 48)
        gemv = torch.from_numpy(rows @ w.numpy().T).reshape(*shape[:-1], 17)
        dense = torch.nn.functional.linear(x, w)
        with pl.trace() as t:
            assert torch.equal(pl.linear(x, w), dense)
        assert [e.kernel for e in t] == ["torch.nn.functional.linear"]
        assert torch.equal(model_linear(bk.xp, x, w, None), gemv if one_row else dense)
        got = model_linear(bk.xp, x, w, b)
        assert_close(got, x64 @ w64.T + b64, backend="torch", dtype="float32")
        torch.set_num_threads(2)
        assert torch.equal(model_linear(bk.xp, x, w, None), torch.nn.functional.linear(x, w))
        assert torch.equal(pl.linear(x, w), torch.nn.functional.linear(x, w))
        torch.set_num_threads(1)
        dx = np.broadcast_to(w64.sum(axis=0), shape)  # d sum(x @ w.T + b) / dx
        xg = x.clone().requires_grad_()
        model_linear(bk.xp, xg, w, b).sum().backward()
        assert_close(xg.grad, dx, backend="torch", dtype="float32")
        grad = torch.func.grad(lambda t: model_linear(bk.xp, t, w, b).sum())(x)
        assert_close(grad, dx, backend="torch", dtype="float32")
        with torch.no_grad():  # a weight that requires grad, read without autograd
            got = model_linear(bk.xp, x, w.clone().requires_grad_(), b)
            assert_close(got, x64 @ w64.T + b64, backend="torch", dtype="float32")
    finally:
        torch.set_num_threads(threads)
