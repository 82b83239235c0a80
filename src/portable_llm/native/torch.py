"""PyTorch kernels: ``torch.nn.functional``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from portable_llm._dispatch import native

_HALF = (torch.float16, torch.bfloat16)


@native("torch", "rms_norm", kernel="torch.nn.functional.rms_norm")
def rms_norm(xp: Any, x: Any, weight: Any, *, eps: float) -> Any:
    # torch normalises in float32 for half inputs, casts back, then multiplies: HF's order.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


@native("torch", "softmax", kernel="torch.softmax")
def softmax(xp: Any, x: Any, *, axis: int) -> Any:
    if x.dtype in _HALF:
        return torch.softmax(x, axis, dtype=torch.float32).to(x.dtype)
    return torch.softmax(x, axis)


@native("torch", "silu", kernel="torch.nn.functional.silu")
def silu(xp: Any, x: Any) -> Any:
    return F.silu(x)


@native("torch", "gelu", kernel="torch.nn.functional.gelu")
def gelu(xp: Any, x: Any) -> Any:
    return F.gelu(x)


@native("torch", "gelu_tanh", kernel="torch.nn.functional.gelu(approximate='tanh')")
def gelu_tanh(xp: Any, x: Any) -> Any:
    return F.gelu(x, approximate="tanh")


@native("torch", "relu", kernel="torch.relu")
def relu(xp: Any, x: Any) -> Any:
    return torch.relu(x)


@native("torch", "linear", kernel="torch.nn.functional.linear")
def linear(xp: Any, x: Any, weight: Any, bias: Any = None) -> Any:
    return F.linear(x, weight, bias)
