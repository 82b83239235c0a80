"""The two kernel sets a model's forward is built with: prepared (bound once) or op by op.

:class:`~portable_llm.decoder.model.Model` checks its weights once at load: when every weight
is a plain array of the model's backend in the model's dtype (or a quantized projection,
embedding or LM head, :func:`~portable_llm.decoder.layer_weights.preparable`), it builds the
prepared forward (:func:`prepare`): each layer's projections bound with their kernel
(:mod:`portable_llm.decoder.layer_weights`: quantized projections with their
``quantized_linear`` kernel, packed ones where the backend packs them), and the kernels of the
dense ops (``linear``, ``rms_norm``, the activation) chosen once through the backend's
dispatcher (:class:`~portable_llm.ops.kernels.BoundKernels`). Otherwise, or with
``prepared=False``, the op-by-op forward (:func:`op_by_op`): the same
:class:`~portable_llm.decoder.forward.Forward` over the public ops, each checking its arguments
and casting a weight of another dtype. Both give the same logits, bit for bit.

Where the model's kernels are chosen is here, in one place: a per-model choice is a field of
the kernel set or of the bound weights, made in :func:`prepare` (``activations="int8"``: each
quantized projection bound to ``quantized_linear_int8``; the float products: ``model_linear``,
:data:`~portable_llm.ops.kernels.MODEL_LINEAR`, which both kernel sets take, so that they agree
bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from portable_llm.attn.block import AttnWeights
from portable_llm.backends import Backend
from portable_llm.core.dispatch import dispatcher
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.forward import Forward, check_learned_positions, position_ids
from portable_llm.decoder.layer_weights import (
    Layer,
    MlpWeights,
    Packed,
    QLinear,
    bind_layer,
    bind_weight,
    layer_projections,
    preparable,
)
from portable_llm.ops.activations import activation_op
from portable_llm.ops.checked_kernels import CheckedKernels
from portable_llm.ops.kernels import BOUND_PROJECTIONS, MODEL_LINEAR, BoundKernels
from portable_llm.ops.quant import QuantizedWeight

__all__ = [
    "AttnWeights",
    "Layer",
    "MlpWeights",
    "Packed",
    "Prepared",
    "QLinear",
    "check_learned_positions",
    "op_by_op",
    "position_ids",
    "preparable",
    "prepare",
]

#: The class of a model's prepared forward (``Model.prepared``): the one
#: :class:`~portable_llm.decoder.forward.Forward`, built by :func:`prepare`.
Prepared = Forward


def prepare(
    config: DecoderConfig, bk: Backend, dtype: Any, layers: Sequence[Layer], *,
    embed: Any, norm: Any, head: Any, norm_bias: Any = None, head_bias: Any = None,
    positions: Any = None, reduce: Callable[[Any], Any] | None = None, probe: Any = None,
    activations: str = "float",
) -> Forward:  # fmt: skip
    """The prepared forward of checked weights (:func:`preparable`): projections bound, the
    dense ops' kernels chosen once for ``dtype`` and a norm weight ``probe`` ``(E,)`` (default
    ``norm``; where it lives, the forward's new arrays go). ``reduce``: a tensor-parallel
    rank's all-reduce (``o_proj``'s bias moves after it). ``activations`` (``"float"`` or
    ``"int8"``, :func:`~portable_llm.load`'s): each quantized projection's :class:`QLinear` is
    bound to ``quantized_linear`` or ``quantized_linear_int8``: the model's choice of its
    quantized projections' kernel, made here with the other bindings."""
    d = dispatcher(bk)

    def bind(w: Any) -> Any:
        return bind_weight(d, w, activations)

    bound = [bind_layer(layer, bind) for layer in layers]
    if reduce is not None:  # o_proj's bias after the sum, so that it counts once
        bound = [moved_o_bias(layer) for layer in bound]
    bound_head = bind(head)  # QLinear (quantized) or Packed where packed
    projections = [*(w for layer in bound for w in layer_projections(layer)), bound_head]
    probe = norm if probe is None else probe
    x = bk.xp.zeros((1, 1, config.hidden_size), dtype=dtype, device=bk.device_of(probe))
    kernels = BoundKernels.choose_for(
        bk, x, probe, eps=config.rms_norm_eps, act=activation_op(config.hidden_act, "model"),
        bound=any(type(w) in BOUND_PROJECTIONS for w in projections), linear_op=MODEL_LINEAR,
    )  # fmt: skip
    fwd = Forward(
        config, bk, kernels, bound, embed=embed, norm=norm, head=head, bound_head=bound_head,
        bind=bind, norm_bias=norm_bias, head_bias=head_bias, positions=positions,
        reduce=reduce,
    )  # fmt: skip
    fwd.activations = activations
    fwd.quantized_projections = sum(type(w) is QLinear for w in projections)
    fwd.quantized = isinstance(embed, QuantizedWeight) or fwd.quantized_projections > 0
    return fwd


def moved_o_bias(layer: Layer) -> Layer:
    """``layer`` on a tensor-parallel rank: ``o_proj``'s bias moved after the all-reduce
    (:attr:`Layer.o_bias`), so that the sum counts it once."""
    if layer.attn is None:
        return layer
    return replace(layer, attn=replace(layer.attn, bo=None), o_bias=layer.attn.bo)


def op_by_op(
    config: DecoderConfig, bk: Backend, layers: Sequence[Layer], *,
    embed: Any, norm: Any, head: Any, norm_bias: Any = None, head_bias: Any = None,
    positions: Any = None, reduce: Callable[[Any], Any] | None = None,
) -> Forward:  # fmt: skip
    """The op-by-op forward: the public ops as the kernel set, each checking its arguments
    and casting a float weight of another dtype (:mod:`portable_llm.ops.checked_kernels`)."""
    if reduce is not None:  # o_proj's bias after the sum, so that it counts once
        layers = [moved_o_bias(layer) for layer in layers]
    return Forward(
        config, bk, CheckedKernels(bk, config.hidden_act, MODEL_LINEAR), layers, embed=embed,
        norm=norm, head=head, norm_bias=norm_bias, head_bias=head_bias, positions=positions,
        reduce=reduce,
    )  # fmt: skip
