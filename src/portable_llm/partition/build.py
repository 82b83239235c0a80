"""A partitioned model built from a reader: each rank reads its own tensors (or slices) only."""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_llm.backends import Backend
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.model import Model
from portable_llm.ops.quant import QuantizedWeight, dequantized, fastest_form
from portable_llm.partition.engine import Engine, QuantizedSlice, Reader
from portable_llm.partition.model import PartitionedModel
from portable_llm.partition.plan import PartitionPlan

__all__ = ["build_partitioned"]

_EMBED, _NORM, _HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def build_partitioned(
    engine: Engine,
    config: DecoderConfig,
    shapes: dict[str, tuple[int, ...]],
    read: Reader,
    backend: Backend,
    dtype: Any,
    device: Any = None,
    *,
    group_size: int | None = None,
    dequantize: bool | str = False,
    tokenizer: Any = None,
    generation_config: dict[str, Any] | None = None,
) -> Model:
    """The model of ``engine``'s groups over the checkpoint that ``read`` reads.

    ``shapes``: every tensor's name (HF's, experts stacked) and full shape; ``read(name,
    index)``: that slice, as a NumPy array of ``dtype`` or, for a weight kept quantized, a
    :class:`~portable_llm.partition.engine.QuantizedSlice` of whole groups (``group_size``: the
    largest group of the weights split along their input). ``dequantize``: what
    :func:`portable_llm.load`'s option does with each rank's quantized weights (``"auto"``:
    :func:`~portable_llm.ops.quant.fastest_form` of the rank's slice; ``False`` keeps them).
    The plans are checked before anything is read (``ValueError`` naming the heads or sizes
    that do not split, or a split that would cut a quantization group). A group of size one
    on both keywords gives the plain :class:`~portable_llm.decoder.model.Model`; so does tensor
    parallelism alone on JAX (the weights sharded over the mesh, the forward unchanged: XLA
    inserts the collectives).
    """
    plans = engine.plans(config, group_size)
    opts = {"tokenizer": tokenizer, "generation_config": generation_config}

    def arr(x: np.ndarray) -> Any:
        return backend.from_numpy(np.ascontiguousarray(x), device)

    def host(name: str, plan: PartitionPlan) -> Any:
        x = engine.place(name, shapes[name], plan, read)
        if isinstance(x, np.ndarray) and plan.zeroed(name):
            x = np.zeros_like(x)
        if isinstance(x, QuantizedSlice):  # kept quantized: the rank's whole groups
            x = QuantizedWeight(*map(arr, x[:3]), bits=x.bits, group_size=x.group_size)
        if isinstance(x, QuantizedWeight) and dequantize:
            return fastest_form(x) if dequantize == "auto" else dequantized(x)
        return arr(x) if isinstance(x, np.ndarray) else x

    if engine.single_controller:
        weights: dict[str, Any] = {}
        for plan in plans:
            for name in shapes:
                if plan.held(name):
                    key = _HEAD if name == _EMBED and not plan.first else name
                    weights[key] = host(name, plan)
        if engine.pp_size == 1:
            return Model(config, weights, backend, **opts)
        stages = {p.pp_rank: p.layers for p in plans}
        return PartitionedModel(
            config, weights, backend, engine=engine, stages=stages, full_config=config, **opts
        )
    (plan,) = plans
    weights = {plan.local_name(n): host(n, plan) for n in shapes if plan.held(n)}
    if not plan.first:  # the model needs an embedding: the head's, or an empty one
        head = weights.pop(_EMBED, None)
        if head is not None:
            weights[_HEAD] = head
        E = config.hidden_size
        weights[_EMBED] = backend.from_numpy(np.zeros((0, E), np.float32), device)
    if not plan.last:
        weights[_NORM] = backend.from_numpy(np.zeros((0,), np.float32), device)
    for key in (_EMBED, _NORM):
        if weights[key].dtype != dtype:
            weights[key] = backend.astype(weights[key], dtype)
    if engine.tp_size == engine.pp_size == 1:
        return Model(plan.config, weights, backend, **opts)
    stages = {plan.pp_rank: range(len(plan.layers))}
    return PartitionedModel(
        plan.config, weights, backend, engine=engine, stages=stages, full_config=config, **opts
    )
