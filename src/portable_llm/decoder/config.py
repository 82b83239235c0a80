"""The decoder configuration: one frozen dataclass read from an HF ``config.json``.

Field names are HF's (``hidden_size``, ``num_key_value_heads``, ``rms_norm_eps``, ...).
:meth:`DecoderConfig.from_dict` reads what every family shares, Llama's way; what a family
changes (its spellings and defaults, its fields, its window rule, its RoPEs: Qwen2's fixed q/k/v
biases, Qwen3's q/k norms, Mistral's window on every layer, Qwen2-MoE's sparse-step rule) is its
file's, ``decoder/families/<model_type>.py``, resolved once into plain fields the model reads
without knowing the family.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from portable_llm.core.checks import check_int
from portable_llm.decoder.config_values import read_bool as _bool
from portable_llm.decoder.config_values import read_int as _int
from portable_llm.decoder.config_values import read_real as _real
from portable_llm.decoder.families import FAMILIES, Family
from portable_llm.ops.activations import ACTIVATIONS
from portable_llm.rotary.scaling import check_dims, rope_spec

__all__ = [
    "READ_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "DecoderConfig",
    "check_model_type",
    "hf_spelling",
]

#: The ``model_type`` values :func:`portable_llm.load` reads and runs: one per family file
#: (``decoder/families/<model_type>.py``).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)
#: Families whose ``config.json`` :meth:`DecoderConfig.from_dict` reads (their fields resolved
#: below) but whose forward the decoder does not run yet: ``pl.load`` refuses them by name.
#: None today (``llama4_text`` was one until its forward came).
READ_MODEL_TYPES: tuple[str, ...] = ()
LAYER_TYPES = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "conv",
    "linear_attention",
)
#: The layer types whose token mixer is a recurrent one, not attention (LFM2's ``"conv"``,
#: Qwen3-Next's ``"linear_attention"``): their family reads a
#: :class:`~portable_llm.decoder.mixer.RecurrentMixer` and no attention
#: (:func:`~portable_llm.decoder.families.base.drop_attention` takes its tensors out).
RECURRENT_LAYER_TYPES = ("conv", "linear_attention")
#: A model type of no family file (one of :data:`READ_MODEL_TYPES`): Llama's defaults and layer.
_LLAMA_LIKE = Family("")


def hf_spelling(d: Mapping[str, Any]) -> dict[str, Any]:
    """``config.json``'s dict with a family's own spellings (GPT-2's ``n_layer``, ``n_embd``,
    ...; LayerNorm eps names; Gemma's activation) also under HF's usual names, where those are
    absent: what :meth:`DecoderConfig.from_dict` and the checkpoint's count checks read."""
    aliases = _family_of(d.get("model_type")).aliases
    return {**{new: d[old] for old, new in aliases.items() if old in d}, **d}


def _family_of(model_type: Any) -> Family:
    return FAMILIES.get(model_type, _LLAMA_LIKE)


def check_model_type(d: Mapping[str, Any]) -> str:
    """The ``model_type`` of a ``config.json`` dict if :func:`portable_llm.load` runs it.

    The first check of a checkpoint, before any other (a BERT folder is answered with its model
    type, not with what its weights lack).

    Raises
    ------
    ValueError
        Any other model type; the message names it and lists the supported ones.
    """
    mt = d.get("model_type") if isinstance(d, Mapping) else None
    if mt in SUPPORTED_MODEL_TYPES:
        return str(mt)
    raise ValueError(
        f"config.json: unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


@dataclass(frozen=True)
class DecoderConfig:
    """A Llama-style decoder, with the options the supported families need.

    Read one with :meth:`from_dict` (an HF ``config.json`` as a dict) or :func:`read_config`.
    ``rope`` holds the options of :func:`portable_llm.rotary.rope` (``base``, ``scaling``,
    ``max_position_embeddings``); ``layer_types[i]`` is ``"full_attention"`` or
    ``"sliding_attention"`` (then ``sliding_window`` applies); ``moe_layers[i]`` says whether
    layer i is a mixture of experts.

    The fields after ``pad_token_id`` carry what the families beyond Llama change (the family
    table of docs/models.md): the norm (``"rms"`` or ``"layer"``, Gemma's ``1 + w`` as
    ``norm_offset``), GPT-2's learned positions, Phi-2's parallel block and plain MLP, Gemma's
    embedding scale, sandwich norms, attention scale and soft-capping, Gemma 3's RoPE of its
    sliding layers, and Llama 4's chunked attention, no-RoPE layers, temperature tuning, q/k L2
    norm and sigmoid router. ``rms_norm_eps`` is the eps of every norm (LayerNorm's too).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str = "silu"
    max_position_embeddings: int | None = None
    rope: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q_proj, k_proj, v_proj biases
    o_bias: bool = False  # o_proj bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False  # Llama mlp_bias
    qk_norm: bool = False  # Qwen3 q_norm / k_norm
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Mixture of experts (Mixtral, Qwen2-MoE); num_experts == 0: every layer is a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # -- the families beyond Llama (defaults: Llama's behaviour) --------------------------------
    norm: str = "rms"  # "rms" (RMSNorm) or "layer" (LayerNorm with weight and bias)
    norm_offset: float = 0.0  # Gemma: the norm's scale is 1 + weight
    # Qwen3-Next: the scale offset + weight formed and applied in float32 per call (HF's order,
    # one rounding: pl.rms_norm(offset=)), not formed once at load in the model's dtype
    norm_offset_per_call: bool = False
    position_embedding: str = "rope"  # "rope" or "learned" (GPT-2's wpe)
    parallel_block: bool = False  # Phi-2: h + attention(norm(h)) + mlp(norm(h)), one norm
    gated_mlp: bool = True  # False: down(act(up(x))) (GPT-2 c_fc/c_proj, Phi-2 fc1/fc2)
    lm_head_bias: bool = False  # Phi-2
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and around the MLP
    attn_scale: float | None = None  # Gemma: query_pre_attn_scalar ** -0.5 (None: D ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: attn_logit_softcapping
    final_softcap: float | None = None  # Gemma 2: final_logit_softcapping
    rope_local: Mapping[str, Any] | None = None  # Gemma 3: RoPE of the sliding layers
    attention_chunk_size: int | None = None  # Llama 4: chunked_attention layers
    no_rope_layers: tuple[bool, ...] = ()  # Llama 4: True where a layer has no RoPE
    attn_temperature_tuning: bool = False  # Llama 4, on the no-RoPE layers
    floor_scale: float = 8192.0  # Llama 4 temperature tuning
    attn_temperature_scale: float = 0.1  # Llama 4 temperature tuning (HF attn_scale)
    qk_l2_norm: bool = False  # Llama 4: weightless RMS norm of q and k on RoPE layers
    router: str = "softmax"  # "softmax" or "sigmoid" (Llama 4: scales the expert inputs)
    norm_bias: bool = True  # a LayerNorm's bias (Cohere 2's LayerNorm has none)
    post_norms: bool = False  # OLMo 2: each sublayer's output normed, not its input
    qk_norm_whole: bool = False  # OLMo 2: q/k norms over all heads' features, (H * D,)
    embedding_multiplier: float = 1.0  # Granite: the embeddings times it
    residual_multiplier: float = 1.0  # Granite: each sublayer's output times it
    logit_scale: float = 1.0  # Granite (1 / logits_scaling), Cohere 2: the logits times it
    # DeepSeek V3's multi-head latent attention (kv_lora_rank 0: none; head_dim is then
    # qk_rope_head_dim, HF's too) and grouped router (router="grouped")
    kv_lora_rank: int = 0  # R: the latent a layer caches per token, with d_r rotary features
    q_lora_rank: int | None = None  # the query's LoRA rank (None: a plain q_proj)
    qk_nope_head_dim: int = 0  # d_n
    v_head_dim: int = 0  # d_v
    n_group: int = 1  # groups of experts
    topk_group: int = 1  # groups kept per token
    routed_scaling_factor: float = 1.0  # the routed experts' weights times it
    # The options of a hybrid family's recurrent mixers, as its file reads them from
    # config.json (LFM2's conv_L_cache, ...): empty for a model without them.
    mixer: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    swiglu_limit: float | None = None  # gpt-oss: the experts' clamped SwiGLU (None: act)
    swiglu_alpha: float = 1.702  # gpt-oss: its sigmoid's slope

    def cache_dims(self, layer: int, *, paged: bool = False) -> tuple[int, int]:
        """``(H_kv, D)`` of the keys layer ``layer``'s cache takes per token: the heads', or
        a latent layer's one latent ``(1, R)`` (its values: ``(1, d_r)``, the rotary key);
        in a page pool a latent layer's pages hold ``[c_kv, k_pe]``, ``(1, R + d_r)``, as
        both keys and values (:func:`~portable_llm.decoder.paged_step.forward`)."""
        if not self.kv_lora_rank:
            return self.num_key_value_heads, self.head_dim
        return 1, self.kv_lora_rank + (self.head_dim if paged else 0)

    def window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (``None``: full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    # Over 80 lines by its docstring (the refusals it makes, ~17 lines): the body reads each
    # field once, in DecoderConfig's order, the family rules in the helpers below.
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DecoderConfig:
        """Read an HF ``config.json`` dict; keys the decoder does not use are ignored.

        Raises
        ------
        ValueError
            A ``model_type`` neither supported nor in :data:`READ_MODEL_TYPES` (the message
            lists the supported ones; :func:`check_model_type` refuses the read-only ones), an
            unknown rope type or layer type, a missing or inconsistent size, or a value of the wrong
            type or range (``rms_norm_eps < 0``, a token id that is not an int, a flag that is
            not a bool, ...), or sizes the forward cannot run with (heads that do not split,
            an odd rotated width, a ``longrope`` factor list of the wrong length, more experts
            per token than experts, a sliding layer without a window >= 1: see
            :func:`_check_forward_needs`).
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"config.json: expected an object ({{...}}), got {type(d).__name__}")
        mt = d.get("model_type")
        if mt not in READ_MODEL_TYPES:
            mt = check_model_type(d)  # the families it reads: READ_MODEL_TYPES too
        fam = _family_of(mt)
        d = {k: v for k, v in hf_spelling(d).items() if k not in fam.ignores}
        d = {**d, **{k: v for k, v in fam.defaults.items() if d.get(k) is None}}  # HF's class's
        d = {**d, **{k: v for k, v in fam.derived(d).items() if d.get(k) is None}}
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            _int(d, key, required=True)
        E, n, H = d["hidden_size"], d["num_hidden_layers"], d["num_attention_heads"]
        act = d.get("hidden_act", "silu")
        if not isinstance(act, str) or act not in ACTIVATIONS:
            raise ValueError(
                f"config.json: unknown hidden_act {act!r}; known: {', '.join(sorted(ACTIVATIONS))}"
            )
        bias = _bool(d, "attention_bias")
        window, layer_types = _check_layer_types(fam.layer_types(d, n), n)
        rope, rope_local = fam.read_ropes(d)
        values: dict[str, Any] = dict(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=E,
            intermediate_size=_int(d, "intermediate_size", required=True),
            num_hidden_layers=n,
            num_attention_heads=H,
            num_key_value_heads=_int(d, "num_key_value_heads") or H,
            head_dim=_int(d, "head_dim") or E // H,
            rms_norm_eps=_real(d, "rms_norm_eps", 1e-6, low=0.0),
            hidden_act=act,
            max_position_embeddings=_int(d, "max_position_embeddings"),
            rope=MappingProxyType(rope),
            tie_word_embeddings=_bool(d, "tie_word_embeddings"),
            qkv_bias=bias,
            o_bias=bias and fam.o_bias,
            sliding_window=window,
            layer_types=layer_types,
            moe_layers=(False,) * n,
            bos_token_id=_token(d, "bos_token_id"),
            eos_token_id=_tokens(d, "eos_token_id"),
            pad_token_id=_token(d, "pad_token_id", low=None),
            rope_local=None if rope_local is None else MappingProxyType(rope_local),
        )
        # a family's own fields win over the common reads above (Qwen2's q/k/v biases, Cohere
        # 2's head_dim, StarCoder2's use_bias for every bias, the experts, ...)
        cfg = cls(**{**values, **fam.fields(d, n)})
        _check_forward_needs(cfg)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``rope`` and ``mixer`` as dicts)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["mixer"] = dict(self.mixer)
        for key in ("rope", "rope_local"):
            rope = getattr(self, key)
            if rope is not None:
                out[key] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in rope.items()}
        return out


def _check_forward_needs(cfg: DecoderConfig) -> None:
    """Refuse, at load, the values a forward cannot run with: what transformers 5 refuses (its
    config validators, and the models it cannot build or run) is the floor. The one place of
    these checks: every reader (folders, GGUF metadata, mlx-lm) comes through
    :meth:`DecoderConfig.from_dict`.

    - heads: ``num_attention_heads`` a multiple of ``num_key_value_heads`` (every family), and
      ``hidden_size`` a multiple of ``num_attention_heads`` where transformers asks for it
      (the family's ``whole_heads``);
    - RoPE: the rotated width ``int(head_dim * partial_rotary_factor)`` even, and what its
      scaling needs of it (a ``longrope`` factor per rotated pair, ``dynamic``'s width > 2);
    - experts: ``num_experts_per_tok`` in ``[1, num_experts]``;
    - windows: a sliding layer needs ``sliding_window >= 1``, a chunked one (Llama 4) an
      ``attention_chunk_size`` (transformers cannot run a window of 0, nor such a layer
      without its size).
    """
    H, H_kv, D, E = (
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    )  # fmt: skip
    if H % H_kv:
        raise ValueError(
            f"config.json: num_attention_heads={H} is not a multiple of num_key_value_heads={H_kv}"
        )
    whole = _family_of(cfg.model_type).whole_heads
    if whole and E % H:
        raise ValueError(
            f"config.json: hidden_size={E} is not a multiple of num_attention_heads={H} "
            f"({cfg.model_type} splits the hidden size into whole heads)"
        )
    if D < 1:
        raise ValueError(
            f"config.json: head_dim must be >= 1; hidden_size={E} // num_attention_heads={H} "
            "is 0 (give head_dim)"
        )
    if cfg.position_embedding == "rope":
        for rope in (cfg.rope, cfg.rope_local):
            if rope is not None:
                _check_rotated_width(rope, D)
    if cfg.num_experts and not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(
            f"config.json: num_experts_per_tok={cfg.num_experts_per_tok} must be in "
            f"[1, num_experts={cfg.num_experts}]"
        )
    if "sliding_attention" in cfg.layer_types and not (cfg.sliding_window or 0) >= 1:
        raise ValueError(
            f"config.json: sliding_window={cfg.sliding_window!r} but layer_types has "
            "sliding_attention layers, which need a window >= 1 (transformers cannot run "
            "them either)"
        )
    if "chunked_attention" in cfg.layer_types and cfg.attention_chunk_size is None:
        raise ValueError(
            "config.json: attention_chunk_size is null but layer_types has chunked_attention "
            "layers, which need a chunk size (transformers cannot run them either)"
        )


def _check_rotated_width(rope: Mapping[str, Any], D: int) -> None:
    """The width RoPE rotates (:func:`portable_llm.rotary.rope`'s ``dims``) of heads of ``D``
    features, checked against ``rope``'s scaling as the forward will use it."""
    spec = rope_spec(
        "config.json",
        rope["scaling"],
        base=rope["base"],
        max_position_embeddings=rope.get("max_position_embeddings"),
    )
    prf = spec.partial_rotary_factor
    dims = D if prf is None else int(D * prf)  # HF: int(head_dim * partial_rotary_factor)
    if dims < 2 or dims % 2:
        what = f"head_dim={D}" if prf is None else f"int(head_dim={D} * {prf})={dims}"
        raise ValueError(
            f"config.json: RoPE rotates pairs of features, but the rotated width is {what} "
            "(it must be even and >= 2)"
        )
    check_dims("config.json", spec, dims)


def _token(d: Mapping[str, Any], key: str, *, low: int | None = 0) -> int | None:
    value = d.get(key)
    if isinstance(value, list | tuple):  # some configs list one id
        value = value[0] if value else None
    if value is None:
        return None
    try:
        return check_int("config.json", key, value, low=low)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _tokens(d: Mapping[str, Any], key: str) -> tuple[int, ...]:
    value = d.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list | tuple) else [value]
    return tuple(_token({key: v}, key) or 0 for v in values)


def _check_layer_types(
    rule: tuple[int | None, list[Any]], n: int
) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` of a family's rule, its ``n`` kinds checked."""
    window, kinds = rule
    if len(kinds) != n or any(not isinstance(k, str) or k not in LAYER_TYPES for k in kinds):
        raise ValueError(
            f"config.json: layer_types must list {n} entries from {LAYER_TYPES}, got {kinds!r}"
        )
    return window, tuple(kinds)
