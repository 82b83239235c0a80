"""The weights of the prepared forward (:mod:`portable_llm.decoder.prepared`), bound at load.

Each decoder layer's weights go into typed records (:class:`AttnWeights`, :class:`MlpWeights`,
:class:`Layer`); the dense ops' kernels are chosen once (:class:`Kernels`). A projection is a
plain array of the model's backend and dtype, or one that carries its kernel: a
:class:`QLinear` for a :class:`~portable_llm.ops.quant.QuantizedWeight` (``quantized_linear``'s
kernel chosen once per shape of the activations, as the public op chooses it per call) or a
:class:`Packed` one where the backend packs the weight once (``pack_linear``: oneDNN's layout
for bfloat16 on torch's CPU), whose kernel gives ``linear``'s bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from portable_llm.backends import Backend, backend_of
from portable_llm.core.dispatch import portable
from portable_llm.ops.quant import QuantizedWeight

__all__ = [
    "AttnWeights",
    "Kernels",
    "Layer",
    "MlpWeights",
    "Packed",
    "QLinear",
    "bind_layer",
    "bind_weight",
    "layer_projections",
    "preparable",
]

Fn = Callable[..., Any]


@dataclass(frozen=True)
class Kernels:
    """The implementations of the dense ops, chosen once for the model's dtype."""

    linear: Fn  # fn(xp, x, w, b)
    rms_norm: Fn  # fn(xp, x, w, *, eps)
    act: Fn  # fn(xp, x)

    def project(self, xp: Any, x: Any, w: Any, b: Any) -> Any:
        """``x @ w.T + b`` for a float weight, a :class:`Packed` or a :class:`QLinear` one."""
        if type(w) in _BOUND:
            return w(xp, x, b)
        return self.linear(xp, x, w, b)


@portable("pack_linear")
def _unpacked(xp: Any, w: Any) -> Any:
    """No packed layout: the weight as it is (a backend's native kernel may pack it)."""
    return w


@dataclass(frozen=True)
class Packed:
    """A float projection in a layout that the backend packed once at load (``pack_linear``,
    e.g. oneDNN's for bfloat16 on torch's CPU), with its ``packed_linear`` kernel: the bits of
    ``linear`` on the plain weight (tested)."""

    w: Any  # (O, I), packed
    fn: Fn  # fn(xp, x, w, b)

    def __call__(self, xp: Any, x: Any, b: Any) -> Any:
        return self.fn(xp, x, self.w, b)


@dataclass(frozen=True)
class QLinear:
    """A quantized projection ``(N, K)`` (MLX's affine format) with its kernels.

    ``quantized_linear``'s kernel is chosen once per weight and shape of ``x``'s leading axes
    (``auto`` looks at the row count: a few rows of a decode step take another portable path
    than a prefill), then called directly.
    """

    packed: Any  # (N, K * bits / 32) uint32
    scales: Any  # (N, K / group_size)
    biases: Any  # (N, K / group_size)
    bits: int
    group_size: int
    pick: Fn  # pick(x, packed, scales, biases, b, **format): the dispatcher's auto choice
    fns: dict[tuple[Any, ...], Fn] = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, xp: Any, x: Any, b: Any) -> Any:
        """``x @ dequantize(w).T + b`` in x's dtype."""
        opts = {"bits": self.bits, "group_size": self.group_size}
        key = (*x.shape[:-1], b is None)
        fn = self.fns.get(key)
        if fn is None:
            fn = self.fns[key] = self.pick(x, self.packed, self.scales, self.biases, b, **opts)
        return fn(xp, x, self.packed, self.scales, self.biases, b, **opts)


_BOUND = (Packed, QLinear)  # projections that carry their kernel


@dataclass(frozen=True)
class AttnWeights:
    """One layer's attention: projections ``(out, E)`` (arrays, :class:`Packed` or
    :class:`QLinear`), optional biases and q/k norms."""

    wq: Any  # (H * D, E)
    wk: Any  # (H_kv * D, E)
    wv: Any  # (H_kv * D, E)
    wo: Any  # (E, H * D)
    bq: Any  # (H * D,) or None
    bk: Any  # (H_kv * D,) or None
    bv: Any  # (H_kv * D,) or None
    bo: Any  # (E,) or None: HF's o_proj bias, added after the projection
    q_norm: Any  # (D,) or None (Qwen3)
    k_norm: Any  # (D,) or None
    window: int | None  # the layer's sliding window


@dataclass(frozen=True)
class MlpWeights:
    """A dense gated MLP: ``down(act(gate(x)) * up(x))`` (weights: as :class:`AttnWeights`)."""

    w_gate: Any  # (I, E)
    w_up: Any  # (I, E)
    w_down: Any  # (E, I)
    b_gate: Any  # (I,) or None
    b_up: Any  # (I,) or None
    b_down: Any  # (E,) or None


@dataclass(frozen=True)
class Layer:
    """One decoder layer: norms, attention, and a dense MLP or the public ``moe``'s arguments."""

    input_norm: Any  # (E,)
    post_norm: Any  # (E,)
    attn: AttnWeights
    mlp: MlpWeights | None
    moe: dict[str, Any] | None  # {"arrays": ..., "options": ...} of portable_llm.ops.moe


def _arrays(block: Any) -> list[Any]:
    a = block.attn
    out = [block.input_norm, block.post_norm, block.o_bias]
    out += [a[k] for k in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm")]
    if block.mlp is not None:
        out += [*block.mlp, *(block.mlp_options.get(f"b_{k}") for k in ("gate", "up", "down"))]
    return [x for x in out if x is not None]


#: The attention's projections: with the MLP's, the weights that may be quantized or packed.
_PROJECTIONS = ("wq", "wk", "wv", "wo")


def _projections(block: Any) -> list[Any]:
    return [*(block.attn[k] for k in _PROJECTIONS), *(block.mlp or ())]


def preparable(bk: Backend, dtype: Any, arrays: Sequence[Any], blocks: Sequence[Any]) -> bool:
    """Whether every weight the prepared layers bind is a plain ``bk`` array of ``dtype`` (not
    another float dtype that the ops would cast per call) or, for the embedding, the LM head and
    the projections, a :class:`~portable_llm.ops.quant.QuantizedWeight` of ``bk``."""
    quantizable = {id(w) for w in arrays} | {id(w) for b in blocks for w in _projections(b)}
    for x in [*arrays, *(w for b in blocks for w in _arrays(b))]:
        if isinstance(x, QuantizedWeight):
            if x.backend is not bk or id(x) not in quantizable:
                return False
            continue
        try:
            if backend_of(x) is not bk or x.dtype != dtype:
                return False
        except TypeError:  # a type no backend knows
            return False
    return True


def bind_weight(d: Any, w: Any) -> Any:
    """``w`` bound for the prepared forward: a :class:`QLinear` for a quantized weight, a
    :class:`Packed` one where the backend packs it (``pack_linear``), else ``w`` itself."""
    if isinstance(w, QuantizedWeight):
        pick = partial(d.pick, "quantized_linear", "auto")
        return QLinear(*w.arrays, bits=w.bits, group_size=w.group_size, pick=pick)
    packed = d.pick("pack_linear", "auto", w)(d.backend.xp, w)
    if packed is w:
        return w
    return Packed(packed, d.pick("packed_linear", "native"))


def bind_layer(block: Any, bind: Callable[[Any], Any]) -> Layer:
    a = block.attn
    wq, wk, wv, wo = (bind(a[k]) for k in _PROJECTIONS)
    attn = AttnWeights(
        wq=wq, wk=wk, wv=wv, wo=wo, bq=a["bq"], bk=a["bk"], bv=a["bv"],
        bo=block.o_bias, q_norm=a["q_norm"], k_norm=a["k_norm"], window=a["window"],
    )  # fmt: skip
    dense = None
    if block.mlp is not None:
        opts = block.mlp_options
        biases = (opts.get(f"b_{k}") for k in ("gate", "up", "down"))
        dense = MlpWeights(*(bind(w) for w in block.mlp), *biases)
    return Layer(block.input_norm, block.post_norm, attn, dense, block.moe)


def layer_projections(layer: Layer) -> tuple[Any, ...]:
    """The projections a layer binds: the attention's, then a dense MLP's."""
    a, m = layer.attn, layer.mlp
    return (a.wq, a.wk, a.wv, a.wo, *(() if m is None else (m.w_gate, m.w_up, m.w_down)))
