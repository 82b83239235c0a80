"""The weights of the prepared forward (:mod:`portable_llm.decoder.prepared`), bound at load.

Each decoder layer's weights go into the records the bodies of the public ops take
(:class:`~portable_llm.attn.block.AttnWeights`, :class:`~portable_llm.ops.linear.MlpWeights`)
and a :class:`Layer`. A projection is a plain array of the model's backend and dtype, or one
that carries its kernel (:mod:`portable_llm.ops.kernels`): a :class:`QLinear` for a
:class:`~portable_llm.ops.quant.QuantizedWeight` (``quantized_linear``'s kernel chosen once per
shape of the activations, as the public op chooses it per call) or a :class:`Packed` one where
the backend packs the weight once (``pack_linear``: oneDNN's layout for bfloat16 on torch's
CPU), whose kernel gives ``linear``'s bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from portable_llm.attn.block import AttnWeights
from portable_llm.attn.latent import LatentWeights
from portable_llm.backends import Backend, backend_of
from portable_llm.decoder.mixer import RecurrentMixer
from portable_llm.ops.kernels import Packed, QLinear
from portable_llm.ops.linear import MlpWeights
from portable_llm.ops.moe import MoeWeights
from portable_llm.ops.quant import QuantizedWeight, projection_op

__all__ = [
    "AttnWeights",
    "Layer",
    "MlpWeights",
    "MoeWeights",
    "Packed",
    "QLinear",
    "RecurrentMixer",
    "bind_layer",
    "bind_weight",
    "layer_projections",
    "preparable",
]


@dataclass(frozen=True)
class Layer:
    """One decoder layer: norms, its token mixers (attention, a recurrent mixer, or both), and a
    dense MLP or the public ``moe``'s arguments; the only per-layer record (read from the
    checkpoint by its family's recipe, its projections bound for the prepared forward by
    :func:`bind_layer`).

    ``attn``: the attention, or ``None`` in a layer whose only token mixer is ``mixer``.
    ``mixer``: a recurrent token mixer (:class:`~portable_llm.decoder.mixer.RecurrentMixer`:
    LFM2's short convolution, Qwen3-Next's Gated DeltaNet, Falcon-H1's Mamba-2), run on the same
    normed input as the attention; with both, their outputs are added (Falcon-H1). A layer has
    at least one of the two.

    ``parallel`` (Phi-2): attention and MLP both read ``input_norm``'s output and are added to
    the residual together; there is no ``post_norm``. The norm biases are LayerNorm's.
    ``o_proj``'s bias is ``attn.bo``, or on a tensor-parallel rank ``o_bias``: added after the
    all-reduce, so that the sum counts it once."""

    input_norm: Any  # (E,)
    post_norm: Any  # (E,), or None (parallel)
    attn: AttnWeights | LatentWeights | None  # LatentWeights: DeepSeek V3's latent attention
    mlp: MlpWeights | None
    moe: MoeWeights | None
    input_bias: Any = None  # (E,): LayerNorm's bias
    post_bias: Any = None  # (E,)
    parallel: bool = False
    attn_norm: Any = None  # (E,): Gemma's norm of the attention output
    ff_norm: Any = None  # (E,): Gemma's norm of the MLP output
    o_bias: Any = None  # (E,): o_proj's bias after a tensor-parallel all-reduce (else attn.bo)
    mixer: RecurrentMixer | None = None  # a token mixer that is not attention

    def __post_init__(self) -> None:
        if self.attn is None and self.mixer is None:
            raise ValueError("Layer: a layer needs a token mixer: attn, mixer or both")
        if self.mixer is not None and not isinstance(self.mixer, RecurrentMixer):
            raise TypeError(
                f"Layer: mixer must be a RecurrentMixer, got {type(self.mixer).__name__}"
            )

    @property
    def norm_weight(self) -> Any:
        """A norm weight ``(E,)`` of the layer (where it lives, its arrays live): the input
        norm's, else (OLMo 2, which norms the outputs only) the attention output's."""
        return self.input_norm if self.input_norm is not None else self.attn_norm


#: The arrays of a latent attention layer other than its projections (:data:`_LATENT_PROJ`).
_LATENT_ARRAYS = ("bq_a", "q_a_norm", "bkv_a", "kv_a_norm", "w_uk", "w_uv", "bo")
#: The projections of a latent attention layer the prepared forward binds.
_LATENT_PROJ = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")


def _arrays(layer: Layer) -> list[Any]:
    a, m = layer.attn, layer.mlp
    out = [layer.input_norm, layer.post_norm, layer.o_bias, layer.input_bias, layer.post_bias]
    out += [layer.attn_norm, layer.ff_norm]
    if isinstance(a, LatentWeights):
        out += [getattr(a, n) for n in (*_LATENT_PROJ, *_LATENT_ARRAYS)]
    elif a is not None:
        out += [a.wq, a.wk, a.wv, a.wo, a.wg, a.bq, a.bk, a.bv, a.bg, a.q_norm, a.k_norm]
    if m is not None:
        out += [m.w_gate, m.w_up, m.w_down, m.b_gate, m.b_up, m.b_down]
    if layer.mixer is not None:
        out += layer.mixer.arrays()
    return [x for x in out if x is not None]


def preparable(bk: Backend, dtype: Any, arrays: Sequence[Any], layers: Sequence[Layer]) -> bool:
    """Whether every weight the prepared layers bind is a plain ``bk`` array of ``dtype`` (not
    another float dtype that the ops would cast per call) or, for the embedding, the LM head and
    the projections, a :class:`~portable_llm.ops.quant.QuantizedWeight` of ``bk``."""
    quantizable = {id(w) for w in arrays} | {
        id(w) for layer in layers for w in layer_projections(layer)
    }
    for x in [*arrays, *(w for layer in layers for w in _arrays(layer))]:
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


def bind_weight(d: Any, w: Any, activations: str = "float") -> Any:
    """``w`` bound for the prepared forward: a :class:`QLinear` for a quantized weight (its op
    that of ``activations``: :func:`~portable_llm.ops.quant.int8.projection_op`), a
    :class:`Packed` one where the backend packs it (``pack_linear``), else ``w`` itself."""
    if isinstance(w, QuantizedWeight):
        op = projection_op(activations, "model")
        pick, fast = partial(d.pick, op, "auto"), partial(d.specialized, op)
        return QLinear(
            *w.arrays, bits=w.bits, group_size=w.group_size, pick=pick, specialize=fast, op=op
        )
    packed = d.pick("pack_linear", "auto", w)(d.backend.xp, w)
    if packed is w:
        return w
    return Packed(packed, d.pick("packed_linear", "native"))


def bind_layer(layer: Layer, bind: Callable[[Any], Any]) -> Layer:
    """``layer`` with each projection bound by ``bind`` (:func:`bind_weight`)."""
    a, m = layer.attn, layer.mlp
    if isinstance(a, LatentWeights):
        bound: dict[str, Any] = {
            n: None if getattr(a, n) is None else bind(getattr(a, n)) for n in _LATENT_PROJ
        }
        a = replace(a, **bound)
    elif a is not None:
        a = replace(a, wq=bind(a.wq), wk=bind(a.wk), wv=bind(a.wv), wo=bind(a.wo))
        if a.wg is not None:  # Qwen3-Next's output gate
            a = replace(a, wg=bind(a.wg))
    if m is not None:
        gate = None if m.w_gate is None else bind(m.w_gate)
        m = replace(m, w_gate=gate, w_up=bind(m.w_up), w_down=bind(m.w_down))
    mixer = None if layer.mixer is None else layer.mixer.bound(bind)
    return replace(layer, attn=a, mlp=m, mixer=mixer)


def layer_projections(layer: Layer) -> tuple[Any, ...]:
    """The projections a layer binds: the attention's (its output gate too; a latent one's:
    :data:`_LATENT_PROJ` that it has), then a dense MLP's, then its recurrent mixer's."""
    a, m = layer.attn, layer.mlp
    attn: tuple[Any, ...] = ()
    if isinstance(a, LatentWeights):  # the latent attention's that it has
        attn = tuple(w for w in (getattr(a, n) for n in _LATENT_PROJ) if w is not None)
    elif a is not None:
        attn = (a.wq, a.wk, a.wv, a.wo, *(() if a.wg is None else (a.wg,)))
    mlp = () if m is None else (w for w in (m.w_gate, m.w_up, m.w_down) if w is not None)
    mixer = () if layer.mixer is None else layer.mixer.projection_weights()
    return (*attn, *mlp, *mixer)
