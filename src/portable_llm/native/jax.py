"""JAX kernels: ``jax.nn`` and ``jax.numpy`` with float32 accumulation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from portable_llm._dispatch import native

_F64 = jnp.dtype(jnp.float64)


def _compute(dtype: Any) -> Any:
    return jnp.float64 if dtype == _F64 else jnp.float32


@native("jax", "softmax", kernel="jax.nn.softmax")
def softmax(xp: Any, x: Any, *, axis: int) -> Any:
    return jax.nn.softmax(x.astype(_compute(x.dtype)), axis=axis).astype(x.dtype)


@native("jax", "silu", kernel="jax.nn.silu")
def silu(xp: Any, x: Any) -> Any:
    return jax.nn.silu(x.astype(_compute(x.dtype))).astype(x.dtype)


@native("jax", "gelu", kernel="jax.nn.gelu(approximate=False)")
def gelu(xp: Any, x: Any) -> Any:
    return jax.nn.gelu(x.astype(_compute(x.dtype)), approximate=False).astype(x.dtype)


@native("jax", "gelu_tanh", kernel="jax.nn.gelu(approximate=True)")
def gelu_tanh(xp: Any, x: Any) -> Any:
    return jax.nn.gelu(x.astype(_compute(x.dtype)), approximate=True).astype(x.dtype)


@native("jax", "relu", kernel="jax.nn.relu")
def relu(xp: Any, x: Any) -> Any:
    return jax.nn.relu(x)


@native("jax", "linear", kernel="jnp.matmul(preferred_element_type=float32)")
def linear(xp: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    acc = _compute(x.dtype)
    y = jnp.matmul(x, weight.T, preferred_element_type=acc)
    if bias is not None:
        y = y + bias.astype(acc)
    return y.astype(x.dtype)
