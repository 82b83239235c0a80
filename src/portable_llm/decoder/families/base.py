"""What every family shares: the :class:`Family` record, and the layer of transformers' Llama.

A family file (``decoder/families/<model_type>.py``) holds what its architecture changes and
nothing else; the rest is here:

- :class:`Family`: the HF names of ``config.json`` it reads (``aliases``), HF's class defaults
  where the file leaves a field out, the :class:`~portable_llm.decoder.config.DecoderConfig`
  fields that differ (``fields``), which layers slide (``layer_types``) and its layer recipe
  (``read_layer``);
- :func:`read_layer`: the layer of transformers' Llama under the HF names
  ``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` (or the experts of
  ``mlp.experts`` and the router ``mlp.gate``), ``input_layernorm`` and
  ``post_attention_layernorm``, the names the checkpoint readers give every family's tensors;
  its pieces (:func:`read_attention`, :func:`read_mlp`, :func:`read_moe`) for a recipe of its
  own.

A family file takes the config as a :class:`LayerConfig` (the fields a layer reads), so it
sits below ``decoder/config.py``, which looks families up by ``model_type``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from portable_llm.attn.block import AttnWeights
from portable_llm.decoder.config_values import (
    read_bool,
    read_int,
    read_layer_types,
    read_real,
    read_rope,
)
from portable_llm.decoder.layer_weights import Layer
from portable_llm.ops.linear import MlpWeights
from portable_llm.ops.moe import MoeWeights

__all__ = [
    "Family",
    "LayerConfig",
    "drop_attention",
    "grouped_moe_fields",
    "grouped_moe_tensors",
    "layer_rope",
    "mlp_tensors",
    "no_windows",
    "qwen2_layer_types",
    "read_attention",
    "read_count",
    "read_layer",
    "read_mlp",
    "read_moe",
    "window_everywhere",
]


class LayerConfig(Protocol):
    """The fields of :class:`~portable_llm.decoder.config.DecoderConfig` a layer recipe reads."""

    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def hidden_act(self) -> str: ...
    @property
    def moe_layers(self) -> tuple[bool, ...]: ...
    @property
    def num_experts_per_tok(self) -> int: ...
    @property
    def norm_topk_prob(self) -> bool: ...
    @property
    def router(self) -> str: ...
    @property
    def n_group(self) -> int: ...
    @property
    def topk_group(self) -> int: ...
    @property
    def routed_scaling_factor(self) -> float: ...
    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def q_lora_rank(self) -> int | None: ...
    @property
    def qk_nope_head_dim(self) -> int: ...
    @property
    def v_head_dim(self) -> int: ...
    @property
    def sandwich_norms(self) -> bool: ...
    @property
    def parallel_block(self) -> bool: ...
    @property
    def position_embedding(self) -> str: ...
    @property
    def rope(self) -> Mapping[str, Any]: ...
    @property
    def rope_local(self) -> Mapping[str, Any] | None: ...
    @property
    def layer_types(self) -> tuple[str, ...]: ...
    @property
    def no_rope_layers(self) -> tuple[bool, ...]: ...
    @property
    def attention_chunk_size(self) -> int | None: ...
    @property
    def qk_l2_norm(self) -> bool: ...
    @property
    def attn_temperature_tuning(self) -> bool: ...
    @property
    def floor_scale(self) -> float: ...
    @property
    def attn_temperature_scale(self) -> float: ...
    @property
    def swiglu_limit(self) -> float | None: ...
    @property
    def swiglu_alpha(self) -> float: ...

    @property
    def mixer(self) -> Mapping[str, Any]: ...

    def window(self, layer: int) -> int | None: ...


#: ``read_layer(config, weights, i)``: layer ``i`` of the weights (HF names).
ReadLayer = Callable[[LayerConfig, Mapping[str, Any], int], Layer]


@dataclass(frozen=True)
class Family:
    """One architecture, as ``decoder/config.py`` and the model read it (see the module
    docstring).

    ``aliases``: the family's own ``config.json`` names -> HF's usual ones (read where the usual
    one is absent). ``ignores``: names its HF class does not read (GPT-2 has no ``head_dim``).
    ``defaults``: HF's class defaults of the usual names where ``config.json`` leaves them out
    (``head_dim``, ``hidden_act``, ``tie_word_embeddings``, ``rope_theta``, ...);
    ``derived(d)``: those that HF's class computes from others (GPT-2's ``n_inner``).
    ``whole_heads``: transformers refuses ``hidden_size % num_attention_heads != 0``.
    ``o_bias``: ``attention_bias`` also gives ``o_proj`` a bias. ``fields(d, n)``: the
    :class:`~portable_llm.decoder.config.DecoderConfig` fields that differ from Llama's, of the
    dict ``d`` of ``n`` layers. ``layer_types(d, n)``: ``(sliding_window, layer_types)``
    (default: Qwen2's rule, :func:`qwen2_layer_types`). ``ropes(d)``: ``(rope, rope of the
    sliding layers or None)`` where layer types have RoPEs of their own (Gemma 3; default: one,
    :func:`~portable_llm.decoder.config_values.read_rope`). ``read_layer``: the layer recipe.
    ``interleaved_rope``: RoPE rotates the pairs ``(2i, 2i + 1)`` (``rope["traditional"]``),
    not HF's rotate-half ones. ``rope_renames``: older names of a rope type (Phi-3's ``su``).
    ``names``: the family's checkpoint names that differ from Llama's, as ``(file's,
    Llama's)`` pieces of a tensor's name (StarCoder2's ``.mlp.c_fc.``). ``tensors(cfg, i,
    out)``: amends layer ``i``'s entries of the checkpoint's expected tensors ``out`` (HF name
    -> shape; what the config's fields imply, :func:`~portable_llm.checkpoint.weights.
    expected_shapes`) where the family's differ (Qwen2-MoE's shared expert). ``extra_layers``:
    its checkpoints may hold layers past ``num_hidden_layers`` that transformers does not run
    (DeepSeek V3's multi-token-prediction modules, ``num_nextn_predict_layers``): not read, and
    not reported as unexpected.
    """

    model_type: str
    aliases: Mapping[str, str] = field(default_factory=dict)
    ignores: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    derived: Callable[[Mapping[str, Any]], dict[str, Any]] = lambda d: {}
    whole_heads: bool = False
    o_bias: bool = False
    fields: Callable[[Mapping[str, Any], int], dict[str, Any]] = lambda d, n: {}
    layer_types: Callable[[Mapping[str, Any], int], tuple[Any, list[str]]] = field(
        default=lambda d, n: qwen2_layer_types(d, n)
    )
    ropes: Callable[[Mapping[str, Any]], tuple[dict[str, Any], dict[str, Any] | None]] | None = None
    read_layer: Callable[..., Layer] = field(default=lambda *a: read_layer(*a))
    interleaved_rope: bool = False
    rope_renames: Mapping[str, str] = field(default_factory=dict)
    names: tuple[tuple[str, str], ...] = ()
    tensors: Callable[[Any, int, dict[str, tuple[int, ...]]], None] | None = None
    extra_layers: bool = False

    def read_ropes(self, d: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """``(rope, rope of the sliding layers or None)`` of the ``config.json`` dict ``d``."""
        if self.ropes is not None:
            return self.ropes(d)
        return read_rope(d, interleaved=self.interleaved_rope, renames=self.rope_renames), None


def mlp_tensors(
    out: dict[str, tuple[int, ...]],
    p: str,
    E: int,
    I: int,  # noqa: E741
    bias: bool,
    gated: bool = True,
) -> None:
    """The tensors of an MLP under the prefix ``p`` (``...mlp.``) into ``out``: HF's
    ``{gate,up,down}_proj`` (the plain MLP: no gate), with biases where ``bias``."""
    for name, shape in (("gate", (I, E)), ("up", (I, E)), ("down", (E, I))):
        if name == "gate" and not gated:  # the plain MLP: up (fc1) and down (fc2)
            continue
        out[f"{p}{name}_proj.weight"] = shape
        if bias:
            out[f"{p}{name}_proj.bias"] = shape[:1]


def read_count(d: Mapping[str, Any], key: str, default: int, low: int = 1) -> int:
    """The count ``key`` of ``config.json`` (an int ``>= low``), ``default`` when absent."""
    value = read_int(d, key, low=low)
    return default if value is None else int(value)


def grouped_moe_fields(
    d: Mapping[str, Any],
    n: int,
    *,
    experts: int,
    dense: int,
    size: int,
    groups: tuple[int, int],
    scale: float,
) -> dict[str, Any]:
    """The :class:`~portable_llm.decoder.config.DecoderConfig` fields of the grouped router's
    experts (DeepSeek V3, GLM-4.5), with each family's defaults: ``n_routed_experts``
    (``experts``) after the first ``first_k_dense_replace`` (``dense``) dense layers, of
    ``moe_intermediate_size`` (``size``), ``num_experts_per_tok`` (8), ``norm_topk_prob``
    (true), ``n_shared_experts`` (1) shared experts as one MLP, ``(n_group, topk_group)``
    (``groups``) and ``routed_scaling_factor`` (``scale``)."""
    x = read_count(d, "n_routed_experts", experts, low=0)
    first_moe = read_count(d, "first_k_dense_replace", dense, low=0)
    width = read_count(d, "moe_intermediate_size", size)
    return {
        "num_experts": x,
        "num_experts_per_tok": read_count(d, "num_experts_per_tok", 8),
        "norm_topk_prob": read_bool(d, "norm_topk_prob", True),
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": width * read_count(d, "n_shared_experts", 1, low=0),
        "moe_layers": tuple(x > 0 and i >= first_moe for i in range(n)),
        "router": "grouped",
        "n_group": read_count(d, "n_group", groups[0]),
        "topk_group": read_count(d, "topk_group", groups[1]),
        "routed_scaling_factor": read_real(d, "routed_scaling_factor", scale, low=0.0),
    }


def grouped_moe_tensors(cfg: Any, i: int, out: dict[str, tuple[int, ...]]) -> None:
    """A sparse layer's tensors beside its experts under the grouped router (DeepSeek V3,
    GLM-4.5): the router's ``gate.e_score_correction_bias`` ``(X,)`` and the shared experts
    (HF ``mlp.shared_experts``, read as ``mlp.shared_expert``) of
    ``shared_expert_intermediate_size`` (``moe_intermediate_size * n_shared_experts``)."""
    if cfg.moe_layers[i]:
        m = f"model.layers.{i}.mlp."
        out[m + "gate.e_score_correction_bias"] = (cfg.num_experts,)
        if cfg.shared_expert_intermediate_size:
            I_s = cfg.shared_expert_intermediate_size
            mlp_tensors(out, m + "shared_expert.", cfg.hidden_size, I_s, False)


def drop_attention(out: dict[str, tuple[int, ...]], i: int) -> None:
    """Take layer ``i``'s attention tensors out of the expected ``out`` (a hybrid family's
    ``tensors`` on a layer whose token mixer is a recurrent one:
    :data:`~portable_llm.decoder.config.RECURRENT_LAYER_TYPES`)."""
    prefix = f"model.layers.{i}.self_attn."
    for name in [n for n in out if n.startswith(prefix)]:
        del out[name]


def no_windows(d: Mapping[str, Any], n: int) -> tuple[None, list[str]]:
    """Every layer attends to all before it (Llama, GPT-2, Phi-2): no window, read or not."""
    return None, ["full_attention"] * n


def window_everywhere(d: Mapping[str, Any], n: int) -> tuple[int | None, list[str]]:
    """``sliding_window`` (when set) on every layer (Mistral, Mixtral, Phi-3)."""
    window = read_int(d, "sliding_window", low=0)
    return window, ["sliding_attention" if window is not None else "full_attention"] * n


def qwen2_layer_types(
    d: Mapping[str, Any], n: int, *, every_other: bool = False
) -> tuple[int | None, list[str]]:
    """Qwen2's rule (HF's ``__post_init__``): ``use_sliding_window`` switches the window on; then
    ``layer_types`` as given, else the layers from ``max_window_layers`` (default 28) on slide.
    ``every_other`` (Qwen2-MoE): the odd-numbered (1-based) layers below it slide instead."""
    # 0 is read as a window of 0 (refused where a layer slides), not as none: null is none
    window = read_int(d, "sliding_window", low=0)
    if not read_bool(d, "use_sliding_window"):
        window = None
    mwl = read_int(d, "max_window_layers", low=0)
    mwl = 28 if mwl is None else mwl
    slides = window is not None
    given = read_layer_types(d)
    if given is not None:
        return window, given
    if every_other:
        return window, [
            "sliding_attention" if slides and (i + 1) % 2 and i < mwl else "full_attention"
            for i in range(n)
        ]
    return window, [
        "sliding_attention" if slides and i >= mwl else "full_attention" for i in range(n)
    ]


def read_layer(cfg: LayerConfig, w: Mapping[str, Any], i: int) -> Layer:
    """Layer ``i`` of the weights ``w`` (HF names, the model's backend): Llama's, with the
    options the config gives (Phi-2's parallel block, Gemma 3's sandwich norms, MoE)."""
    p = f"model.layers.{i}."
    sandwich = cfg.sandwich_norms  # Gemma: post_attention_layernorm norms attention's output
    post = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
    moe = cfg.moe_layers[i]
    return Layer(
        input_norm=w[p + "input_layernorm.weight"],
        post_norm=w.get(p + post + ".weight"),
        attn=read_attention(cfg, w, i),
        mlp=None if moe else read_mlp(w, i),
        moe=read_moe(cfg, w, i) if moe else None,
        input_bias=w.get(p + "input_layernorm.bias"),
        post_bias=w.get(p + "post_attention_layernorm.bias"),
        parallel=cfg.parallel_block,
        attn_norm=w.get(p + "post_attention_layernorm.weight") if sandwich else None,
        ff_norm=w.get(p + "post_feedforward_layernorm.weight") if sandwich else None,
    )


def read_attention(cfg: LayerConfig, w: Mapping[str, Any], i: int) -> AttnWeights:
    """Layer ``i``'s attention: ``model.layers.{i}.self_attn.*``."""
    a = f"model.layers.{i}.self_attn."
    return AttnWeights(
        wq=w[a + "q_proj.weight"],
        wk=w[a + "k_proj.weight"],
        wv=w[a + "v_proj.weight"],
        wo=w[a + "o_proj.weight"],
        bq=w.get(a + "q_proj.bias"),
        bk=w.get(a + "k_proj.bias"),
        bv=w.get(a + "v_proj.bias"),
        bo=w.get(a + "o_proj.bias"),
        q_norm=w.get(a + "q_norm.weight"),
        k_norm=w.get(a + "k_norm.weight"),
        window=cfg.window(i),
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        norm_eps=cfg.rms_norm_eps,
        rope=layer_rope(cfg, i) is not None,
        **_llama4_attention(cfg, i),
    )


def read_mlp(w: Mapping[str, Any], i: int) -> MlpWeights:
    """Layer ``i``'s dense MLP: ``model.layers.{i}.mlp.{gate,up,down}_proj`` (no gate: the
    plain MLP of GPT-2 and Phi-2)."""
    m = f"model.layers.{i}.mlp."
    return MlpWeights(
        *(w.get(f"{m}{k}_proj.weight") for k in ("gate", "up", "down")),
        *(w.get(f"{m}{k}_proj.bias") for k in ("gate", "up", "down")),
    )


def read_moe(cfg: LayerConfig, w: Mapping[str, Any], i: int) -> MoeWeights:
    """Layer ``i``'s mixture of experts (``model.layers.{i}.mlp.``): the public ``moe``'s
    arrays and options."""
    m = f"model.layers.{i}.mlp."
    options: dict[str, Any] = {
        "top_k": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router": cfg.router,  # Llama 4: "sigmoid", the scores scale the experts' inputs
        "act": cfg.hidden_act,
    }
    if cfg.router == "grouped":  # DeepSeek V3, GLM-4.5: group-limited, a correction bias
        options.update(
            n_group=cfg.n_group, topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor,
            e_score_correction_bias=w.get(m + "gate.e_score_correction_bias"),
        )  # fmt: skip
    s = m + "shared_expert."
    if s + "gate_proj.weight" in w:  # Qwen2-MoE (gated by shared_expert_gate), Llama 4,
        # DeepSeek V3 (its shared_experts, read under this name)
        options["shared"] = tuple(w[f"{s}{k}_proj.weight"] for k in ("gate", "up", "down"))
    if m + "shared_expert_gate.weight" in w:  # Qwen2-MoE
        options["shared_gate"] = w[m + "shared_expert_gate.weight"]
    arrays = (w[m + "gate.weight"], *(w[f"{m}experts.{k}_proj"] for k in ("gate", "up", "down")))
    return MoeWeights(*arrays, **options)


def _llama4_attention(cfg: LayerConfig, i: int) -> dict[str, Any]:
    """Layer ``i``'s options of Llama 4's attention (HF ``Llama4TextAttention``): the chunk of a
    ``chunked_attention`` layer; the weightless q/k norm on RoPE layers (``use_qk_norm``); the
    temperature tuning on the no-RoPE ones (``attn_temperature_tuning``)."""
    chunked = cfg.layer_types[i] == "chunked_attention" and cfg.attention_chunk_size
    no_rope = bool(cfg.no_rope_layers) and cfg.no_rope_layers[i]
    tuned = no_rope and cfg.attn_temperature_tuning
    return {
        "chunk": cfg.attention_chunk_size if chunked else None,
        "qk_l2_norm": cfg.qk_l2_norm and not no_rope,
        "temperature": (cfg.floor_scale, cfg.attn_temperature_scale) if tuned else None,
    }


def layer_rope(cfg: LayerConfig, i: int) -> Any:
    """Layer ``i``'s RoPE options: none (learned positions, Llama 4's no-RoPE layers), Gemma
    3's ``rope_local`` on its sliding layers, else the model's."""
    if cfg.position_embedding != "rope" or (cfg.no_rope_layers and cfg.no_rope_layers[i]):
        return None
    if cfg.rope_local is not None and cfg.layer_types[i] == "sliding_attention":
        return cfg.rope_local
    return cfg.rope
