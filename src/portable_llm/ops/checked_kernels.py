"""The kernel set of the public ops: each call checks its arguments, then dispatches.

A model's op-by-op forward (``Model(..., prepared=False)``, or a model whose weights are in
mixed float dtypes, which the prepared forward does not take) is the one decoder forward over
this kernel set (:class:`~portable_llm.ops.kernels.KernelSet`): every projection is the public
:func:`~portable_llm.linear` (``quantized_linear`` for a ``QuantizedWeight``), every norm the
public :func:`~portable_llm.rms_norm` or :func:`~portable_llm.layer_norm`, each validating its
arrays and casting a float weight of another dtype to the activations' (the mixed-precision
rule); any other kernel (RoPE, the attention) is asked of the dispatcher per call, as the
public ops ask it. The same kernels as the bound set's, so the same logits, bit for bit: a
model's float products go to the op its prepared set binds (``linear_op``, a model's
:data:`~portable_llm.ops.kernels.MODEL_LINEAR`), checked as the public ``linear`` checks them.
"""

from __future__ import annotations

from typing import Any

from portable_llm.backends import Backend
from portable_llm.core.dispatch import pick
from portable_llm.ops.activations import activation, clamped_swiglu
from portable_llm.ops.kernels import Fn
from portable_llm.ops.linear import check_linear, linear
from portable_llm.ops.norm import layer_norm, rms_norm
from portable_llm.ops.quant import is_quantized

__all__ = ["CheckedKernels"]


class CheckedKernels:
    """The public ops as a :class:`~portable_llm.ops.kernels.KernelSet` (see the module
    docstring). ``act``: the activation's HF name (``hidden_act``); ``linear_op``: the op of
    the float products (``"linear"``, the public op, or a model's ``MODEL_LINEAR``)."""

    __slots__ = ("act_name", "bk", "linear_op")

    #: Chosen per call: a body asks :meth:`choose` each time (and a trace records it).
    bound = False

    def __init__(self, bk: Backend, act: str, linear_op: str = "linear") -> None:
        self.bk, self.act_name, self.linear_op = bk, act, linear_op

    def choose(self, op: str, *args: Any, **options: Any) -> Fn:
        """``auto``'s implementation of ``op`` for these arguments (recorded by a trace)."""
        return pick(self.bk, op, "auto", *args, **options)

    def linear(self, xp: Any, x: Any, w: Any, b: Any) -> Any:
        if self.linear_op == "linear" or is_quantized(w):
            return linear(x, w, b)  # a QuantizedWeight: quantized_linear
        w, b = check_linear("linear", self.bk, x, w, b, "weight")  # linear's checks and casts
        return pick(self.bk, self.linear_op, "auto", x, w, b)(xp, x, w, b)

    def project(self, xp: Any, x: Any, w: Any, b: Any) -> Any:
        return self.linear(xp, x, w, b)

    def rms_norm(self, xp: Any, x: Any, w: Any, *, eps: float) -> Any:
        return rms_norm(x, w, eps=eps)

    def layer_norm(self, xp: Any, x: Any, w: Any, b: Any, *, eps: float) -> Any:
        return layer_norm(x, w, b, eps=eps)

    def act(self, xp: Any, x: Any) -> Any:
        return activation(self.act_name)(x)

    def glu(self, xp: Any, gate: Any, up: Any, *, limit: float, alpha: float) -> Any:
        return clamped_swiglu(gate, up, limit=limit, alpha=alpha)

    def traced(self) -> CheckedKernels:
        """These kernels: the public ops are recorded by a trace as they run."""
        return self
