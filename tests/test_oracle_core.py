"""Oracles for the foundation ops: HF transformers Qwen2RMSNorm/Qwen2MLP, torch, mx.fast.

These implementations are independent of portable_llm; agreement with them is what users check.
"""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import assert_close, random_array, random_weight, tolerance

pytestmark = pytest.mark.oracle

HALF_AND_FULL = ["float16", "bfloat16", "float32", "float64"]


@pytest.fixture(scope="session")
def qwen2():
    pytest.importorskip("transformers")
    from transformers.models.qwen2 import modeling_qwen2

    return modeling_qwen2


@pytest.mark.parametrize("dtype", HALF_AND_FULL)
@pytest.mark.parametrize("shape", [(1, 896), (2, 7, 64), (3, 1, 5, 32)])
def test_rms_norm_equals_hf_qwen2_rmsnorm(qwen2, dtype, shape):
    torch = pytest.importorskip("torch")
    x, _ = random_array(0, shape, dtype, backend="torch")
    w, _ = random_array(1, shape[-1:], dtype, backend="torch", low=0.5, high=1.5)
    layer = qwen2.Qwen2RMSNorm(shape[-1], eps=1e-6).to(x.dtype)
    with torch.no_grad():
        layer.weight.copy_(w)
        expected = layer(x)
    if dtype == "float64":
        # HF normalises float64 in float32 (it casts to float32 unconditionally); we keep
        # float64, so HF is the less accurate one: float32's tolerance.
        tol = tolerance("float32")
        assert_close(pl.rms_norm(x, w, eps=1e-6), expected, rtol=tol.rtol, atol=tol.atol)
    else:
        # Same order of casts and multiplies as HF: bit-identical on the torch backend.
        assert_close(pl.rms_norm(x, w, eps=1e-6), expected, rtol=0.0, atol=0.0)
    # The NumPy path on the same inputs: within the dtype's tolerance of HF's result.
    tol = tolerance("float32" if dtype == "float64" else dtype)
    out = pl.rms_norm(x, w, eps=1e-6, backend="numpy")
    assert_close(out, expected, backend="numpy", rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize("dtype", HALF_AND_FULL)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "relu"])
def test_mlp_equals_hf_qwen2_mlp(qwen2, dtype, act):
    torch = pytest.importorskip("torch")
    from transformers import Qwen2Config

    e, i = 64, 176
    cfg = Qwen2Config(hidden_size=e, intermediate_size=i, hidden_act=act)
    layer = qwen2.Qwen2MLP(cfg)
    x, _ = random_array(0, (2, 5, e), dtype, backend="torch")
    wg, _ = random_weight(1, (i, e), dtype, backend="torch")
    wu, _ = random_weight(2, (i, e), dtype, backend="torch")
    wd, _ = random_weight(3, (e, i), dtype, backend="torch")
    layer = layer.to(x.dtype)
    with torch.no_grad():
        layer.gate_proj.weight.copy_(wg)
        layer.up_proj.weight.copy_(wu)
        layer.down_proj.weight.copy_(wd)
        expected = layer(x)
    out = pl.mlp(x, wg, wu, wd, act=act)
    assert_close(out, expected)
    assert_close(pl.mlp(x, wg, wu, wd, act=act, impl="portable"), expected)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rms_norm_equals_torch_functional(dtype):
    torch = pytest.importorskip("torch")
    x, _ = random_array(4, (3, 9, 128), dtype)
    w, _ = random_array(5, (128,), dtype)
    expected = torch.nn.functional.rms_norm(torch.from_numpy(x), (128,), torch.from_numpy(w), 1e-5)
    assert_close(pl.rms_norm(x, w, eps=1e-5), pl.to_numpy(expected))


@pytest.mark.parametrize("dtype", HALF_AND_FULL)
def test_rms_norm_equals_mx_fast(dtype):
    mx = pytest.importorskip("mlx.core")
    x, _ = random_array(6, (3, 9, 128), dtype, backend="mlx")
    w, _ = random_array(7, (128,), dtype, backend="mlx", low=0.5, high=1.5)
    expected = mx.fast.rms_norm(x, w, 1e-5)
    assert_close(pl.rms_norm(x, w, eps=1e-5, impl="portable"), expected)
    # The NumPy path on the same (converted) inputs, within what MLX's kernel reaches.
    tol = tolerance(dtype, "mlx")
    out = pl.rms_norm(x, w, eps=1e-5, backend="numpy")
    assert_close(out, pl.to_numpy(expected), backend="numpy", rtol=tol.rtol, atol=tol.atol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_activations_equal_torch(dtype):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    x, _ = random_array(8, (4, 300), dtype, low=-10, high=10)
    t = torch.from_numpy(x)
    for ours, theirs in [
        (pl.silu, F.silu),
        (pl.gelu, F.gelu),
        (pl.gelu_tanh, lambda v: F.gelu(v, approximate="tanh")),
        (pl.relu, F.relu),
        (pl.softmax, lambda v: F.softmax(v, dim=-1)),
    ]:
        assert_close(ours(x), theirs(t).numpy(), err_msg=ours.__name__)
    assert np.all(pl.silu(np.float64([-1e4])) == 0)
