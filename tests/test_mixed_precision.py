"""The mixed-precision rule: a float weight in another dtype is cast to the activations' dtype.

For every op that takes weights, half-precision activations with float32 weights give *exactly*
the result of the same op with the weights cast to the activations' dtype first (as mlx-lm's
modules run float32 weights on float16 inputs); integer weights stay a TypeError. See
docs/mixed-precision.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.testing import random_array, random_weight

HALF = ["float16", "bfloat16"]
X, INTER, E, V = 4, 12, 8, 10  # experts, intermediate, hidden, vocab


def _half(backend: str, half: str) -> None:
    if half not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {half} on its default device")


def _weights(backend: str, dtype: str) -> dict[str, Any]:
    shapes = {
        "norm": (E,), "w": (V, E), "b": (V,), "gate": (INTER, E), "up": (INTER, E),
        "down": (E, INTER), "b_gate": (INTER,), "b_up": (INTER,), "b_down": (E,),
        "router": (X, E), "e_gate": (X, INTER, E), "e_up": (X, INTER, E),
        "e_down": (X, E, INTER), "shared_gate": (1, E), "conv": (E, 3),
    }  # fmt: skip
    return {
        k: random_weight(j + 1, s, dtype, backend=backend)[0]
        for j, (k, s) in enumerate(shapes.items())
    }


def _moe(x: Any, w: dict[str, Any], **opts: Any) -> Any:
    shared = (w["gate"], w["up"], w["down"])
    experts = (w["e_gate"], w["e_up"], w["e_down"])
    return pl.moe(
        x, w["router"], *experts, top_k=2, norm_topk_prob=True, shared=shared,
        shared_gate=w["shared_gate"], **opts,
    )  # fmt: skip


OPS: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "rms_norm": lambda x, w: pl.rms_norm(x, w["norm"]),
    "linear": lambda x, w: pl.linear(x, w["w"], w["b"]),
    "linear_portable": lambda x, w: pl.linear(x, w["w"], w["b"], impl="portable"),
    "mlp": lambda x, w: pl.mlp(
        x, w["gate"], w["up"], w["down"], b_gate=w["b_gate"], b_up=w["b_up"], b_down=w["b_down"]
    ),
    "unembed": lambda x, w: pl.unembed(x, w["w"]),
    "route": lambda x, w: pl.route(x, w["router"], top_k=2, norm_topk_prob=True),
    "moe": lambda x, w: _moe(x, w),
    "moe_dense": lambda x, w: _moe(x, w, impl="dense"),
    "short_conv": lambda x, w: pl.short_conv(x, w["conv"], bias=w["b_down"]),
}


def _same(a: Any, b: Any) -> None:
    if isinstance(a, tuple):
        for u, v in zip(a, b, strict=True):
            _same(u, v)
        return
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    np.testing.assert_array_equal(
        pl.to_numpy(a).astype(np.float64), pl.to_numpy(b).astype(np.float64)
    )


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("half", HALF)
def test_float32_weights_are_cast_to_the_activations_dtype(backend, half, op):
    _half(backend, half)
    x, _ = random_array(0, (2, 3, E), half, backend=backend)
    w32 = _weights(backend, "float32")
    bk = pl.get_backend(backend)
    w_cast = {k: bk.astype(v, x.dtype) for k, v in w32.items()}
    out = OPS[op](x, w32)
    _same(out, OPS[op](x, w_cast))
    first = out[0] if isinstance(out, tuple) else out
    if op != "route":  # route's weights are float32 probabilities by design
        assert first.dtype == x.dtype


@pytest.mark.parametrize("op", list(OPS))
def test_float64_weights_with_float32_activations(backend, op):
    if "float64" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no float64")
    x, _ = random_array(0, (2, 3, E), "float32", backend=backend)
    w64 = _weights(backend, "float64")
    bk = pl.get_backend(backend)
    _same(OPS[op](x, w64), OPS[op](x, {k: bk.astype(v, x.dtype) for k, v in w64.items()}))


@pytest.mark.parametrize(
    ("op", "name"),
    [
        ("rms_norm", "norm"), ("linear", "w"), ("linear", "b"), ("mlp", "down"),
        ("mlp", "b_up"), ("unembed", "w"), ("route", "router"), ("moe", "e_up"),
        ("moe", "shared_gate"), ("short_conv", "conv"),
    ],
)  # fmt: skip
def test_integer_weights_are_a_type_error(backend, op, name):
    x, _ = random_array(0, (2, 3, E), "float32", backend=backend)
    w = _weights(backend, "float32")
    bk = pl.get_backend(backend)
    w[name] = bk.astype(w[name], bk.dtype("int32"))
    with pytest.raises(TypeError, match=r"must have a float dtype .*got int32"):
        OPS[op](x, w)


def test_mixed_libraries_are_a_type_error(other_backend):
    x, _ = random_array(0, (2, E), "float32", backend=other_backend)
    w, _ = random_weight(1, (V, E), "float32")  # NumPy
    with pytest.raises(TypeError, match="linear: got arrays from two libraries"):
        pl.linear(x, w)


def test_embedding_output_is_in_the_table_dtype(backend):
    """embedding has no activations to match: the table's dtype is the output's."""
    ids = pl.asarray(np.array([[1, 3, 0]]), backend=backend)
    for dtype in ("float32", "float16"):
        if dtype not in pl.get_backend(backend).float_dtypes():
            continue
        table, table_r = random_array(0, (V, E), dtype, backend=backend)
        out = pl.embedding(ids, table)
        assert out.dtype == table.dtype
        np.testing.assert_array_equal(pl.to_numpy(out).astype(np.float64), table_r[[[1, 3, 0]]])
