"""A GGUF file's metadata, read with a type and range check per key, and the config it describes.

Every value a hostile file sets is checked where it is read, and a wrong one is a
:class:`~portable_llm.checkpoint.files.CheckpointError` naming the file and the GGUF key: a
count is an integer (a float such as ``2.7`` or a string is refused, never truncated or
parsed), at least 1, and no more layers than the file holds tensors of; a number is finite; a
token id lies inside the vocabulary; the vocabulary has one token per row of ``token_embd``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from portable_llm.checkpoint.config import check_held
from portable_llm.checkpoint.files import CheckpointError, brief
from portable_llm.checkpoint.gguf_header import GGUFTensor, Undecodable
from portable_llm.decoder.config import DecoderConfig

__all__ = [
    "LONGROPE_TENSORS",
    "GGUF_ARCHITECTURES",
    "LAYER_NORM",
    "MODEL_TYPES",
    "NORM_PLUS_ONE",
    "PARTIAL_ROPE",
    "PERMUTED",
    "GGUFMetadata",
    "eos_ids",
    "gguf_config",
]

#: The ``general.architecture`` values :func:`gguf_config` reads. llama.cpp writes Mistral
#: (7B, Nemo) models as ``llama``; there is no ``mistral`` architecture in GGUF.
GGUF_ARCHITECTURES: tuple[str, ...] = (
    "llama",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi2",
    "phi3",
    "gpt2",
    "smollm3",
    "olmo2",
    "granite",
    "starcoder2",
    "cohere2",
    "qwen3moe",
    "lfm2",
    "gpt-oss",
    "falcon-h1",
    "deepseek2",
    "glm4moe",
    "qwen3next",
)
#: llama.cpp's LlamaModel converter (its Mistral, SmolLM3 and Granite subclasses too) permutes
#: the rows of q/k (weights and biases) for its rotary layout; Qwen's, OLMo 2's and StarCoder2's
#: (NeoX rotary) and Cohere 2's (interleaved pairs, llama.cpp's own layout) do not.
PERMUTED: tuple[str, ...] = ("llama", "smollm3", "granite")
#: HF's ``model_type`` of an architecture whose name differs (a Gemma 3 GGUF holds only the
#: text model, as transformers reads it).
MODEL_TYPES: dict[str, str] = {
    "gemma3": "gemma3_text",
    "phi2": "phi",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "falcon-h1": "falcon_h1",
    "deepseek2": "deepseek_v3",
    "glm4moe": "glm4_moe",
    "qwen3next": "qwen3_next",
}
#: The architectures with LayerNorm (``{arch}.attention.layer_norm_epsilon``), not RMSNorm.
LAYER_NORM: tuple[str, ...] = ("phi2", "gpt2", "starcoder2", "cohere2")
#: The architectures whose head size is ``embedding_length / head_count`` (no ``key_length``),
#: RoPE on the first ``rope.dimension_count`` of each head's dimensions (Phi's partial rotary).
PARTIAL_ROPE: tuple[str, ...] = ("phi2", "phi3")
#: The architectures whose norm weights llama.cpp stores as ``1 + w`` (Gemma's RMSNorm scale):
#: the reader subtracts 1, as transformers' ``Gemma2TensorProcessor`` does.
NORM_PLUS_ONE: tuple[str, ...] = ("gemma2", "gemma3")
_LAYER_OF = re.compile(r"^blk\.(\d+)\.")
_SPECIAL_IDS = ("bos", "eos", "eot", "eom")


class GGUFMetadata:
    """A GGUF file's metadata (:attr:`GGUFHeader.fields <portable_llm.checkpoint.gguf_header.
    GGUFHeader.fields>`), with checked getters whose errors name the file and the key."""

    def __init__(self, fields: dict[str, Any], file: Path) -> None:
        self.fields = fields
        self.file = file

    def fail(self, key: str, what: str) -> CheckpointError:
        return CheckpointError(f"load: {str(self.file)!r}: GGUF metadata {key}: {what}")

    def get(self, key: str, default: Any = None) -> Any:
        """The raw value of ``key`` (a str, int, float, bool or list), or ``default``."""
        value = self.fields.get(key)
        if value is None:
            return default
        if isinstance(value, Undecodable):
            raise self.fail(key, f"cannot be read ({value.error})")
        return value

    def need(self, key: str) -> Any:
        """The raw value of ``key``; an error when the file lacks it."""
        if key not in self.fields:
            raise CheckpointError(f"load: {str(self.file)!r}: GGUF metadata key {key} is missing")
        return self.get(key)

    def count(self, key: str) -> int:
        """An integer >= 1 (some files store one per layer: the list's one value)."""
        self.need(key)
        value = self.count_or_none(key)
        assert value is not None
        return value

    def count_or_none(self, key: str) -> int | None:
        """:meth:`count`, or ``None`` when the file lacks ``key``."""
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, list):
            if not value or len(set(map(repr, value))) != 1:
                raise self.fail(key, f"differs between layers ({brief(value)}); not supported")
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(key, f"must be an integer >= 1, got {brief(value)}")
        return value

    def number(self, key: str, default: float | None = None, *, low: float = 0.0) -> float:
        """A finite number >= ``low``."""
        value = self.get(key, default) if default is not None else self.need(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"must be a number, got {brief(value)}")
        if not math.isfinite(value) or value < low:
            raise self.fail(key, f"must be finite and >= {low}, got {brief(value)}")
        return float(value)

    def text(self, key: str, default: str | None = None) -> str:
        """A string."""
        value = self.get(key, default) if default is not None else self.need(key)
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, got {brief(value)}")
        return value

    def items(self, key: str, kinds: tuple[type, ...], what: str, n: int | None) -> list[Any]:
        """A list whose items are ``kinds`` (bools refused unless asked for), of length ``n``
        when given; an empty list when the file lacks it."""
        value = self.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(
            isinstance(v, kinds) and (bool in kinds or not isinstance(v, bool)) for v in value
        ):
            raise self.fail(key, f"must be a list of {what}, got {brief(value)}")
        if n is not None and len(value) != n:
            raise self.fail(key, f"has {len(value)} entries for {n} tokens")
        return value


def check_tokenizer_metadata(meta: GGUFMetadata, vocab: int) -> None:
    """The ``tokenizer.ggml.*`` values checked before a tokenizer is built from them: tokens
    (one per embedding row), their types and scores, merges, special ids inside the vocabulary
    and the add-token flags."""
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if meta.get(key) is not None:
            meta.text(key)
    tokens = meta.items("tokenizer.ggml.tokens", (str,), "strings", None)
    if tokens and len(tokens) != vocab:
        raise meta.fail(
            "tokenizer.ggml.tokens",
            f"has {len(tokens)} tokens but token_embd.weight has {vocab} rows (one per token)",
        )
    meta.items("tokenizer.ggml.token_type", (int,), "integers", len(tokens) or None)
    meta.items("tokenizer.ggml.scores", (int, float), "numbers", len(tokens) or None)
    meta.items("tokenizer.ggml.merges", (str,), "strings", None)
    for name in (*_SPECIAL_IDS, "unknown", "padding", "seperator", "cls", "mask"):
        key = f"tokenizer.ggml.{name}_token_id"
        value = meta.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise meta.fail(key, f"must be an integer token id, got {brief(value)}")
        if name in _SPECIAL_IDS and not 0 <= value < vocab:
            raise meta.fail(key, f"{value} is not a token id (the vocabulary has {vocab})")
    for flag in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        key = f"tokenizer.ggml.{flag}"
        if meta.get(key) is not None and not isinstance(meta.get(key), bool):
            raise meta.fail(key, f"must be a bool, got {brief(meta.get(key))}")


def held_layers(tensors: dict[str, GGUFTensor]) -> int:
    """How many layers the file holds tensors of (``blk.{i}.``)."""
    found = [int(m[1]) for name in tensors if (m := _LAYER_OF.match(name))]
    return max(found) + 1 if found else 0


def gguf_config(meta: GGUFMetadata, tensors: dict[str, GGUFTensor]) -> DecoderConfig:
    """The :class:`DecoderConfig` a GGUF file's metadata describes (transformers' reading),
    every value checked, and the layer count checked against the tensors before anything is
    built from it."""
    arch = _architecture(meta)
    layers = meta.count(f"{arch}.block_count") - mtp_layers(meta, arch)
    check_held(meta.file, f"{arch}.block_count", layers, held_layers(tensors), "layers")
    vocab = _vocab_size(meta, arch, tensors)
    if vocab is not None:
        check_tokenizer_metadata(meta, vocab)
    d = _common_fields(meta, arch, tensors, layers, vocab)
    d.update(_family_fields(meta, arch, d))
    d.update(_arch_fields(meta, arch, tensors))
    if arch == "gpt2":  # learned positions, no RoPE
        del d["rope_theta"]
    d.update(_rope_scaling(meta, arch, tensors))
    try:
        return DecoderConfig.from_dict(d)
    except ValueError as exc:
        raise CheckpointError(f"load: {str(meta.file)!r}: GGUF metadata: {exc}") from None


def _architecture(meta: GGUFMetadata) -> str:
    """``general.architecture``, one of :data:`GGUF_ARCHITECTURES`."""
    arch = meta.text("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"load: {str(meta.file)!r}: unsupported GGUF architecture {brief(arch)} "
            f"(general.architecture); supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def _vocab_size(meta: GGUFMetadata, arch: str, tensors: dict[str, GGUFTensor]) -> int | None:
    """V: the rows of ``token_embd.weight``, else ``{arch}.vocab_size`` (or None)."""
    embed = tensors.get("token_embd.weight")
    if embed is None:
        return meta.count_or_none(f"{arch}.vocab_size")
    shape = tuple(reversed(embed.shape))
    if len(shape) != 2:
        raise CheckpointError(
            f"load: {str(meta.file)!r}: token_embd.weight has shape {shape}; a (V, E) "
            "matrix is needed"
        )
    return int(shape[0])


def _common_fields(
    meta: GGUFMetadata, arch: str, tensors: dict[str, GGUFTensor], layers: int, vocab: int | None
) -> dict[str, Any]:
    """The HF config fields every architecture has, read from ``{arch}.*`` and the tokenizer's
    special ids."""
    head_dim = meta.count_or_none(f"{arch}.attention.key_length")
    if head_dim is None and arch in PERMUTED:
        head_dim = meta.count_or_none(f"{arch}.rope.dimension_count")
    eps = f"{arch}.attention.layer_norm_{'epsilon' if arch in LAYER_NORM else 'rms_epsilon'}"
    return {
        "model_type": MODEL_TYPES.get(arch, arch),
        "vocab_size": vocab,
        "hidden_size": meta.count(f"{arch}.embedding_length"),
        "intermediate_size": meta.count_or_none(f"{arch}.feed_forward_length")
        if arch in _EXPERTS  # a MoE file may hold no dense MLP: HF's default then
        else meta.count(f"{arch}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": meta.count(f"{arch}.attention.head_count"),
        "num_key_value_heads": _kv_heads(meta, arch),
        "head_dim": head_dim,
        "rms_norm_eps": meta.number(eps),
        "rope_theta": meta.number(
            f"{arch}.rope.freq_base", 1e6 if arch == "gemma3" else 10000.0, low=1e-30
        ),
        "max_position_embeddings": meta.count_or_none(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "eos_token_id": eos_ids(meta),
    }


def _kv_heads(meta: GGUFMetadata, arch: str) -> int | None:
    """``H_kv``: ``{arch}.attention.head_count_kv``, or in a hybrid file (:data:`_HYBRID`) the
    one count of its attention layers (0 on the others)."""
    key = f"{arch}.attention.head_count_kv"
    if arch not in _HYBRID or not isinstance(meta.get(key), list):
        return meta.count_or_none(key)
    counts = {c for c in meta.items(key, (int,), "integers", None) if c != 0}
    if len(counts) != 1 or min(counts) < 0:
        raise meta.fail(key, f"must be one count >= 1 and zeros, got {brief(meta.get(key))}")
    return counts.pop()


def _family_fields(meta: GGUFMetadata, arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """The fields of some architectures only (partial RoPE, GELU, no RoPE, Gemma's window and
    softcaps), given the common fields ``d``."""
    out: dict[str, Any] = {}
    if arch in PARTIAL_ROPE:
        heads = d["num_attention_heads"]
        if d["hidden_size"] % heads:
            raise meta.fail(
                f"{arch}.attention.head_count",
                f"{heads} does not divide embedding_length {d['hidden_size']}",
            )
        rope_dim = meta.count_or_none(f"{arch}.rope.dimension_count")
        if rope_dim is not None and rope_dim != d["hidden_size"] // heads:
            out["partial_rotary_factor"] = rope_dim / (d["hidden_size"] // heads)
    if arch in ("phi2", "gpt2"):  # llama.cpp's GELU is the tanh form (HF's gelu_new)
        out["hidden_act"] = "gelu_new"
    if arch in NORM_PLUS_ONE:  # Gemma: transformers reads the window (the pattern: its default)
        out["sliding_window"] = meta.count_or_none(f"{arch}.attention.sliding_window")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):  # as llama.cpp reads them
        if arch == "gemma2" and meta.get(f"{arch}.{cap}") is not None:
            out[cap] = meta.number(f"{arch}.{cap}", low=1e-30)
    return out


#: Each architecture's own numbers (``{arch}.key`` -> HF's config name), each required, as
#: llama.cpp's loader requires them: Granite's four multipliers (llama.cpp divides its logits
#: by ``logit_scale``, HF's ``logits_scaling``; Cohere 2's are multiplied by theirs), Cohere 2's
#: window (every fourth layer global: fixed in llama.cpp, HF's default pattern).
_NUMBERS: dict[str, dict[str, str]] = {
    "granite": {
        "attention.scale": "attention_multiplier",
        "embedding_scale": "embedding_multiplier",
        "residual_scale": "residual_multiplier",
        "logit_scale": "logits_scaling",
    },
    "cohere2": {"logit_scale": "logit_scale"},
}
_COUNTS: dict[str, dict[str, str]] = {
    "cohere2": {"attention.sliding_window": "sliding_window"},
    "gpt-oss": {"attention.sliding_window": "sliding_window"},  # on the even layers (HF's)
    "falcon-h1": {  # the Mamba-2 mixer's sizes (its head size: inner_size / time_step_rank)
        "ssm.conv_kernel": "mamba_d_conv",
        "ssm.inner_size": "mamba_d_ssm",
        "ssm.state_size": "mamba_d_state",
        "ssm.time_step_rank": "mamba_n_heads",
        "ssm.group_count": "mamba_n_groups",
    },
}
#: The MoE architectures' counts. llama.cpp's Qwen3-MoE renormalises the top-k weights and has
#: no dense layers (transformers' GGUF reading sets ``norm_topk_prob`` for it too).
_EXPERTS: dict[str, dict[str, str]] = {
    "qwen3moe": {
        "expert_count": "num_experts",
        "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "moe_intermediate_size",
    },
    "qwen3next": {
        "expert_count": "num_experts",
        "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
    "gpt-oss": {  # HF's intermediate_size is the experts' width
        "expert_count": "num_experts",
        "expert_used_count": "num_experts_per_tok",
        "expert_feed_forward_length": "intermediate_size",
    },
}
#: The hybrid architectures: ``{arch}.attention.head_count_kv`` lists each layer's count, 0 on
#: its recurrent layers (LFM2's short convolutions: ``layer_types`` ``"conv"``).
_HYBRID = ("lfm2",)
#: The architectures whose biases no metadata announces: a converter writes a bias where the
#: HF model has one (``blk.0.attn_q.bias``, ``blk.0.ffn_down.bias``), read where present.
_BIASED = (
    "smollm3",
    "olmo2",
    "granite",
    "starcoder2",
    "cohere2",
    "qwen3moe",
    "gpt-oss",
    "falcon-h1",
    "glm4moe",
)


def _arch_fields(meta: GGUFMetadata, arch: str, tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """The fields of the architectures of issue 31 (:data:`_NUMBERS`, :data:`_COUNTS`,
    :data:`_EXPERTS`, :data:`_BIASED`)."""
    out: dict[str, Any] = {
        hf: meta.number(f"{arch}.{key}", low=1e-30) for key, hf in _NUMBERS.get(arch, {}).items()
    }
    for key, hf in {**_COUNTS.get(arch, {}), **_EXPERTS.get(arch, {})}.items():
        out[hf] = meta.count(f"{arch}.{key}")
    if arch in _EXPERTS:
        out["norm_topk_prob"] = True
    if arch == "lfm2":
        out.update(_lfm2_fields(meta))
    if arch == "falcon-h1":
        out.update(_falcon_h1_fields(tensors))
    if arch == "deepseek2":
        out.update(_deepseek2_fields(meta))
    if arch == "glm4moe":
        out.update(_glm4moe_fields(meta, tensors))
    if arch == "qwen3next":
        out.update(_qwen3next_fields(meta, tensors))
    if arch in _BIASED:
        attn, mlp = "blk.0.attn_q.bias" in tensors, "blk.0.ffn_down.bias" in tensors
        out.update(attention_bias=attn, mlp_bias=mlp)
        if arch == "starcoder2":  # one switch for every bias (its LayerNorms always have one)
            out["use_bias"] = attn
    return out


def _lfm2_fields(meta: GGUFMetadata) -> dict[str, Any]:
    """LFM2's layer kinds (a 0 in ``lfm2.attention.head_count_kv``: a short convolution), its
    convolution's taps ``lfm2.shortconv.l_cache``; ``feed_forward_length`` is the MLP's width
    as llama.cpp's converter adjusted it (HF's ``block_auto_adjust_ff_dim`` done)."""
    layers = meta.count("lfm2.block_count")
    kv = meta.get("lfm2.attention.head_count_kv")
    kinds = kv if isinstance(kv, list) else [kv] * layers
    if len(kinds) != layers:
        raise meta.fail(
            "lfm2.attention.head_count_kv", f"has {len(kinds)} entries for {layers} layers"
        )
    return {
        "layer_types": ["conv" if k == 0 else "full_attention" for k in kinds],
        "conv_L_cache": meta.count("lfm2.shortconv.l_cache"),
        "block_auto_adjust_ff_dim": False,
    }


def _deepseek2_fields(meta: GGUFMetadata) -> dict[str, Any]:
    """DeepSeek V3 as llama.cpp's ``deepseek2`` holds it: the latent attention's ranks and
    head sizes (``key_length_mla`` = ``d_n + d_r``, ``rope.dimension_count`` = ``d_r``; the
    file's ``head_count_kv`` 1 and ``key_length`` ``R + d_r`` describe llama.cpp's MQA form,
    not HF's), the leading dense layers, the grouped sigmoid router (``expert_gating_func``
    2; a softmax router is DeepSeek V2's, not read), its scale, renormalisation and groups
    (llama.cpp's defaults when absent: no scale, no renormalisation, one group)."""
    a = "deepseek2."
    dr = meta.count(a + "rope.dimension_count")
    k_mla = meta.count_or_none(a + "attention.key_length_mla")
    dn = (k_mla or meta.count(a + "attention.key_length")) - dr
    v = meta.count_or_none(a + "attention.value_length_mla")
    if dn < 1:
        raise meta.fail(a + "attention.key_length_mla", f"must exceed rope.dimension_count {dr}")
    return {
        "num_key_value_heads": meta.count(a + "attention.head_count"),  # HF's: H
        "q_lora_rank": meta.count_or_none(a + "attention.q_lora_rank"),
        "kv_lora_rank": meta.count(a + "attention.kv_lora_rank"),
        "qk_rope_head_dim": dr,
        "qk_nope_head_dim": dn,
        "v_head_dim": v or meta.count(a + "attention.value_length"),
        **_grouped_moe_fields(meta, a),
        "rope_interleave": True,  # llama.cpp's rotation of adjacent pairs
    }


def _grouped_moe_fields(meta: GGUFMetadata, a: str) -> dict[str, Any]:
    """The DeepSeek V3 router's fields (DeepSeek V3, GLM-4.5), from the keys ``a`` + ...: the
    leading dense layers, the experts, the shared ones, the scale, the renormalisation and the
    groups (llama.cpp's defaults when absent: no scale, no renormalisation, one group); the
    gating must be 2 (sigmoid)."""
    gating = meta.get(a + "expert_gating_func", 2)
    if gating != 2:
        raise meta.fail(
            a + "expert_gating_func",
            f"{brief(gating)}: only 2 (sigmoid, DeepSeek V3's router) is read; a softmax "
            "router (DeepSeek V2's) is not supported",
        )
    return {
        "first_k_dense_replace": meta.get(a + "leading_dense_block_count", 0),
        "n_routed_experts": meta.count(a + "expert_count"),
        "num_experts_per_tok": meta.count(a + "expert_used_count"),
        "moe_intermediate_size": meta.count(a + "expert_feed_forward_length"),
        "n_shared_experts": meta.get(a + "expert_shared_count", 0),
        "routed_scaling_factor": meta.number(a + "expert_weights_scale", 1.0),
        "norm_topk_prob": bool(meta.get(a + "expert_weights_norm", False)),
        "n_group": meta.count_or_none(a + "expert_group_count") or 1,
        "topk_group": meta.count_or_none(a + "expert_group_used_count") or 1,
    }


def _glm4moe_fields(meta: GGUFMetadata, tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """GLM-4.5 as llama.cpp's ``glm4moe`` holds it: RoPE on ``rope.dimension_count`` of each
    head's features (``partial_rotary_factor``), q/k norms where ``attn_q_norm`` is, the
    DeepSeek V3 router (:func:`_grouped_moe_fields`)."""
    a = "glm4moe."
    D = meta.count_or_none(a + "attention.key_length") or (
        meta.count(a + "embedding_length") // meta.count(a + "attention.head_count")
    )
    rope = meta.count_or_none(a + "rope.dimension_count") or D // 2
    return {
        **_grouped_moe_fields(meta, a),
        "head_dim": D,
        "partial_rotary_factor": rope / D,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
    }


def _qwen3next_fields(meta: GGUFMetadata, tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """Qwen3-Next as llama.cpp's ``qwen3next`` holds it: the Gated DeltaNet's sizes from the
    ``ssm.*`` keys (``group_count`` ``H_k``, ``state_size`` ``D_k``, ``time_step_rank`` ``H``,
    ``inner_size`` ``H D_v``, ``conv_kernel`` ``K``), every ``full_attention_interval``-th layer
    full attention (llama.cpp's rule), RoPE on ``rope.dimension_count`` of each head's
    ``key_length`` features, a MoE on every layer (llama.cpp's: no dense layers), the biases of
    ``q/k/v/o`` where ``attn_q.bias`` is."""
    a = "qwen3next."
    H, inner = meta.count(a + "ssm.time_step_rank"), meta.count(a + "ssm.inner_size")
    if inner % H:
        raise meta.fail(a + "ssm.inner_size", f"{inner} is not a multiple of time_step_rank {H}")
    D = meta.count_or_none(a + "attention.key_length") or (
        meta.count(a + "embedding_length") // meta.count(a + "attention.head_count")
    )
    rope = meta.count_or_none(a + "rope.dimension_count") or D // 4
    return {
        "linear_num_key_heads": meta.count(a + "ssm.group_count"),
        "linear_key_head_dim": meta.count(a + "ssm.state_size"),
        "linear_num_value_heads": H,
        "linear_value_head_dim": inner // H,
        "linear_conv_kernel_dim": meta.count(a + "ssm.conv_kernel"),
        "full_attention_interval": meta.count_or_none(a + "full_attention_interval") or 4,
        "head_dim": D,
        "partial_rotary_factor": rope / D,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": any(name.endswith(".attn_q.bias") for name in tensors),
    }


def mtp_layers(meta: GGUFMetadata, arch: str) -> int:
    """The multi-token-prediction layers a file holds past the model's (GLM-4.5's
    ``{arch}.nextn_predict_layers``, counted in ``block_count``): not run, as transformers does
    not run them."""
    n = meta.get(f"{arch}.nextn_predict_layers", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise meta.fail(f"{arch}.nextn_predict_layers", f"must be an integer >= 0, got {brief(n)}")
    return n


def _falcon_h1_fields(tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """Falcon-H1 as llama.cpp's converter leaves it: every multiplier folded into the weights
    (so 1 here), the mixer's biases and gated norm where their tensors are, the norm after
    the gate (llama.cpp's Mamba-2: ``norm(y * silu(z))``)."""
    ones = dict.fromkeys(
        ("embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier",
         "attention_out_multiplier", "key_multiplier", "ssm_in_multiplier",
         "ssm_out_multiplier"), 1.0,
    )  # fmt: skip
    return {
        **ones,
        "ssm_multipliers": [1.0] * 5,
        "mlp_multipliers": [1.0, 1.0],
        "mamba_d_head": "auto",
        "mamba_rms_norm": "blk.0.ssm_norm.weight" in tensors,
        "mamba_norm_before_gate": False,
        "mamba_conv_bias": "blk.0.ssm_conv1d.bias" in tensors,
        "mamba_proj_bias": "blk.0.ssm_in.bias" in tensors,
        "projectors_bias": "blk.0.ssm_out.bias" in tensors,
    }


def _rope_scaling(meta: GGUFMetadata, arch: str, tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """``rope_scaling`` (and longrope's fields): llama.cpp's ``longrope`` of a ``phi3`` file,
    ``linear``, a ``gpt-oss`` file's ``yarn`` (:func:`_yarn`), or nothing."""
    scaling = meta.text(f"{arch}.rope.scaling.type", "none")
    if arch == "phi3" and any(t in tensors for t in LONGROPE_TENSORS):  # llama.cpp's longrope:
        return _longrope(meta, tensors)  # the factors as tensors, L0 as metadata
    if scaling == "linear":
        factor = meta.number(f"{arch}.rope.scaling.factor", low=1e-30)
        return {"rope_scaling": {"rope_type": "linear", "factor": factor}}
    if scaling == "yarn" and arch in _YARN:
        return _yarn(meta, arch)
    if scaling != "none":
        raise CheckpointError(
            f"load: {str(meta.file)!r}: {arch}.rope.scaling.type {brief(scaling)} is not "
            f"supported (none, linear{', yarn' if arch in _YARN else ''})"
        )
    return {}


#: The architectures whose YaRN is read, with HF's ``truncate`` of the family (gpt-oss: false,
#: the correction range's ends not rounded, as transformers' GptOssConfig; llama.cpp rounds
#: them: where the two disagree this reader follows transformers).
_YARN: dict[str, bool] = {"gpt-oss": False}


def _yarn(meta: GGUFMetadata, arch: str) -> dict[str, Any]:
    """``rope_scaling`` ``yarn`` from ``{arch}.rope.scaling.factor``,
    ``.original_context_length`` and (llama.cpp's defaults 32 and 1 when absent)
    ``.yarn_beta_fast``, ``.yarn_beta_slow``."""
    key = f"{arch}.rope.scaling."
    return {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": meta.number(key + "factor", low=1e-30),
            "original_max_position_embeddings": meta.count(key + "original_context_length"),
            "beta_fast": meta.number(key + "yarn_beta_fast", 32.0),
            "beta_slow": meta.number(key + "yarn_beta_slow", 1.0),
            "truncate": _YARN[arch],
        }
    }


#: llama.cpp's ``longrope`` factors of a ``phi3`` file (float32, one per rotated pair): read
#: into the config's ``rope_scaling``, not weights.
LONGROPE_TENSORS: tuple[str, str] = ("rope_factors_long.weight", "rope_factors_short.weight")


def _longrope(meta: GGUFMetadata, tensors: dict[str, GGUFTensor]) -> dict[str, Any]:
    """The config fields of llama.cpp's Phi-3 ``longrope`` (its ``convert_hf_to_gguf``:
    ``rope_factors_long``/``_short`` tensors, ``phi3.rope.scaling.original_context_length`` and
    ``.attn_factor``) as transformers' ``rope_scaling``."""
    factors = {}
    for name, key in zip(LONGROPE_TENSORS, ("long_factor", "short_factor"), strict=True):
        t = tensors.get(name)
        if t is None or t.kind != "F32" or len(t.shape) != 1:
            raise CheckpointError(
                f"load: {str(meta.file)!r}: a longrope file needs both "
                f"{' and '.join(LONGROPE_TENSORS)} as float32 vectors; {name} is "
                f"{'missing' if t is None else t.kind}"
            )
        factors[key] = t.data.view("<f4").tolist()
    ompe = meta.count("phi3.rope.scaling.original_context_length")
    scaling: dict[str, Any] = {"rope_type": "longrope", **factors}
    attn = meta.get("phi3.rope.scaling.attn_factor")
    if attn is not None:
        scaling["attention_factor"] = meta.number("phi3.rope.scaling.attn_factor", low=1e-30)
    return {"rope_scaling": scaling, "original_max_position_embeddings": ompe}


def eos_ids(meta: GGUFMetadata) -> list[int]:
    """The ids that end a turn: ``tokenizer.ggml.eos_token_id`` (then ``eot``, ``eom``)."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))
