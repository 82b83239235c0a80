"""GGUF files (llama.cpp's format) as a :class:`~portable_llm.models.Model`.

Read by :func:`~portable_llm.checkpoint.gguf_header.read_gguf_header` (the header checked
against the file's size in one pass; the file is memory-mapped; one tensor is decoded at a
time):

- the metadata (``{arch}.block_count``, ``{arch}.attention.head_count``, ...) becomes a
  :class:`~portable_llm.models.DecoderConfig`, through the same ``from_dict`` as ``config.json``;
- the tensors (``blk.{i}.attn_q.weight``, ...) get HF's names (``model.layers.{i}.self_attn.
  q_proj.weight``); for the ``llama``, ``smollm3`` and ``granite`` architectures, the rows of
  ``attn_q``/``attn_k`` (weights and biases) that llama.cpp's converter permuted for its rotary
  layout are put back (as transformers does); a MoE layer's stacked ``ffn_*_exps`` are the
  experts' gate, up and down;
  fused tensors (``attn_qkv``; Phi-3's ``ffn_up``) are split into HF's row blocks, and Gemma's
  norm weights, stored as ``1 + w``, lose the 1;
- quantized tensors stay quantized (:class:`~portable_llm.ops.quant.QuantizedWeight`, MLX's
  affine layout) where the block type is exactly affine per group of 32 or 16
  (:data:`~portable_llm.checkpoint.gguf_blocks.AFFINE_FORMATS`), and are dequantized otherwise, or
  everywhere with ``dequantize=True``;
- the tokenizer (``tokenizer.ggml.*``) becomes a ``tokenizers.Tokenizer`` built as
  transformers builds it from the same file; ``tokenizer.chat_template`` and the EOS ids come
  with it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from portable_llm.backends import Backend
from portable_llm.checkpoint.build import CheckpointContents, LoadOptions
from portable_llm.checkpoint.files import CheckpointError, library_errors, listed
from portable_llm.checkpoint.gguf_blocks import (
    AFFINE_FORMATS,
    BLOCK_SIZES,
    affine_parts,
    dequantize_blocks,
    float16_overflow,
    pack_codes,
)
from portable_llm.checkpoint.gguf_header import GGUFTensor, read_gguf_header
from portable_llm.checkpoint.gguf_meta import (
    GGUF_ARCHITECTURES,
    LONGROPE_TENSORS,
    MODEL_TYPES,
    NORM_PLUS_ONE,
    PERMUTED,
    GGUFMetadata,
    gguf_config,
)
from portable_llm.checkpoint.gguf_tokenizer import gguf_tokenizer
from portable_llm.checkpoint.mlx_layout import join_kv_b
from portable_llm.checkpoint.quantized import float_only
from portable_llm.checkpoint.weights import expected_shapes
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.families import FAMILIES
from portable_llm.partition.engine import QuantizedSlice

__all__ = [
    "GGUF_ARCHITECTURES",
    "GGUFSlices",
    "gguf_config",
    "gguf_tokenizer",
    "read_gguf",
]

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "position_embd": "model.embed_positions",  # GPT-2
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
    "shortconv.conv": "conv.conv",  # LFM2's short convolution (E, K): HF's (E, 1, K)
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
    "ssm_in": "mamba.in_proj",  # Falcon-H1's Mamba-2 mixer
    "ssm_out": "mamba.out_proj",
    "ssm_conv1d": "mamba.conv1d",  # (C, K): HF's (C, 1, K)
    "ssm_norm": "mamba.norm",  # (G, I / G): HF's (I,)
    "attn_q_a": "self_attn.q_a_proj",  # DeepSeek's latent attention
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # older files; newer ones split it (_KV_B)
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
#: llama.cpp's split of DeepSeek's ``kv_b_proj`` ``(H (d_n + d_v), R)``: ``attn_k_b``
#: ``(H, R, d_n)`` (each head's key rows, transposed) and ``attn_v_b`` ``(H, d_v, R)``; read
#: back into the one HF tensor (:func:`_joined_kv_b`).
_KV_B = ("attn_k_b", "attn_v_b")
#: Mamba-2's tensors without a ``.weight``/``.bias`` of their own on one side: llama.cpp's
#: ``blk.{i}.ssm_a`` (``A = -exp(A_log)``, ``(H, 1)``), ``ssm_d`` (``(H, 1)``) and the
#: ``dt_bias`` it names ``ssm_dt.bias``.
_BARE = {
    "ssm_a": "mamba.A_log",
    "ssm_d": "mamba.D",
    "ssm_dt.bias": "mamba.dt_bias",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",  # DeepSeek V3's router
}
_BARE_NAME = re.compile(r"^blk\.(\d+)\.(ssm_a|ssm_d|ssm_dt\.bias|exp_probs_b\.bias)$")
#: Tensors llama.cpp stores with a dimension of 1 squeezed out (LFM2's convolution ``(E, K)``,
#: Falcon-H1's ``(C, K)``; HF's ``(.., 1, K)``): read back in HF's shape.
_SQUEEZED = (".conv.conv.weight", ".mamba.conv1d.weight", ".linear_attn.conv1d.weight")
#: Tensors llama.cpp stores in another shape (and form) than HF's (:func:`_stored_shape`).
_RESHAPED = (*_SQUEEZED, ".mamba.A_log", ".mamba.D", ".mamba.norm.weight")
#: A MoE layer's experts, stacked ``(X, N, K)``: HF v5's ``mlp.experts.{gate_up,down}_proj``
#: (no ``.weight``), the gate and up halves apart as the model takes them.
_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
#: Tensors without HF's ``.weight``: ``blk.{i}.{key}.weight`` -> ``model.layers.{i}.{value}``
#: (the stacked experts' weights, gpt-oss's attention sinks ``(H,)``); the experts' biases
#: (gpt-oss) are ``mlp.experts.{gate,up,down}_bias`` ``(X, I)``, ``(X, I)``, ``(X, E)``.
_UNSUFFIXED = {**_EXPERTS, "attn_sinks": "self_attn.sinks"}
#: gpt-oss's and GLM-4.5's names: ``post_attention_norm`` is the norm before the MLP (HF's
#: ``post_attention_layernorm``); there is no ``ffn_norm``.
_POST_ATTENTION_NORM = {
    **{g: h for g, h in _LAYER.items() if g != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
}
#: Qwen3-Next's names (llama.cpp's ``qwen3next``): ``post_attention_norm`` before the MoE, the
#: shared expert's gate ``ffn_gate_inp_shexp``, and the Gated DeltaNet's: llama.cpp's converter
#: cuts HF's ``in_proj_qkvz`` into ``attn_qkv`` (q, k, v: the convolution's channels, in the
#: order :func:`~portable_llm.decoder.families.qwen3_next.split_qkvz` gives) and ``attn_gate``
#: (z), read as ``linear_attn.in_proj_qkv``/``in_proj_z`` (kept quantized); ``ssm_ba`` is HF's
#: ``in_proj_ba``; ``ssm_a`` holds ``-exp(A_log)`` ``(H,)``; the convolution is ``(C, K)``.
_QWEN3_NEXT = {
    **_POST_ATTENTION_NORM,
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
#: OLMo 2's names (a norm after each sublayer, none before).
_POST_NORMS = {
    **{g: h for g, h in _LAYER.items() if g not in ("attn_norm", "ffn_norm")},
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
#: Gemma's names (sandwich norms): ``ffn_norm`` is the norm before the MLP there, and
#: ``post_attention_norm``/``post_ffw_norm`` norm the outputs of attention and the MLP.
_SANDWICH = {
    **_LAYER,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
#: Tensors that llama.cpp writes fused, rows stacked in this order: split on read.
_FUSED = {
    "attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "ffn_up": ("mlp.gate_proj", "mlp.up_proj"),  # Phi-3's gate_up_proj (its only ffn_up)
}
#: The model types whose norm weights llama.cpp stores as ``1 + w`` (Gemma's; Qwen3-Next's
#: zero-centred norms, but the Gated DeltaNet's gated norm, :data:`_PLAIN_NORM`).
_PLUS_ONE_TYPES = (*(MODEL_TYPES.get(a, a) for a in NORM_PLUS_ONE), "qwen3_next")
_PLAIN_NORM = ".linear_attn.norm.weight"
_PERMUTED_TYPES = tuple(MODEL_TYPES.get(a, a) for a in PERMUTED)
_LAYER_INDEX = re.compile(r"^blk\.(\d+)\.")
_BLK = re.compile(r"^blk\.(\d+)\.([\w.]+)\.(weight|bias)$")


def layer_names(cfg: DecoderConfig) -> dict[str, str]:
    """A layer's GGUF names -> HF's for ``cfg``: Gemma's sandwich norms (``ffn_norm`` is the
    norm before the MLP there), OLMo 2's norms after each sublayer, else Llama's."""
    if cfg.model_type in ("gpt_oss", "glm4_moe"):
        return _POST_ATTENTION_NORM
    if cfg.model_type == "qwen3_next":
        return _QWEN3_NEXT
    return _SANDWICH if cfg.sandwich_norms else _POST_NORMS if cfg.post_norms else _LAYER


def hf_name(name: str, *, layer: dict[str, str] | None = None) -> str | None:
    """HF's name of a GGUF tensor (``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.
    q_proj.weight``; ``blk.0.ffn_gate_exps.weight`` -> ``model.layers.0.mlp.experts.
    gate_proj``), or ``None`` for a name outside the decoder's vocabulary. ``layer``: the
    layer's names (:func:`layer_names`; Llama's by default)."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL and suffix in ("weight", "bias"):  # LayerNorm, Phi-2's lm_head: a bias
        return f"{_GLOBAL[stem]}.{suffix}"
    layer = _LAYER if layer is None else layer
    bare = _BARE_NAME.match(name)
    if bare:
        return f"model.layers.{bare[1]}.{layer.get(bare[2], _BARE[bare[2]])}"
    m = _BLK.match(name)
    if m and m[2] in _KV_B and m[3] == "weight":
        return f"model.layers.{m[1]}.self_attn.kv_b_proj.weight"
    if m and m[2] in _UNSUFFIXED and m[3] == "weight":
        return f"model.layers.{m[1]}.{_UNSUFFIXED[m[2]]}"
    if m and m[2] in _EXPERTS:  # an expert's bias (gpt-oss)
        return f"model.layers.{m[1]}.{_EXPERTS[m[2]].removesuffix('_proj')}_bias"
    if m and m[2] in layer:
        return f"model.layers.{m[1]}.{layer[m[2]]}.{m[3]}"
    return None


def hf_parts(name: str, cfg: DecoderConfig) -> tuple[str, ...]:
    """HF's names of the row blocks of a GGUF tensor: one name, several for a fused tensor
    (``attn_qkv`` -> q, k, v; Phi-3's ``ffn_up`` -> gate, up), none outside the decoder's
    vocabulary."""
    m = _BLK.match(name)
    fused = _FUSED.get(m[2]) if m else None
    if (
        m
        and fused
        and cfg.model_type != "qwen3_next"
        and (m[2] == "attn_qkv" or cfg.model_type == "phi3")
    ):
        return tuple(f"model.layers.{m[1]}.{stem}.{m[3]}" for stem in fused)
    if name == "token_embd_norm.weight" and cfg.model_type == "lfm2":
        return ("model.norm.weight",)  # LFM2's final norm (HF's model.embedding_norm)
    h = hf_name(name, layer=layer_names(cfg))
    return () if h is None else (h,)


def gguf_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """:func:`~portable_llm.checkpoint.weights.expected_shapes`, with each MoE layer's
    ``mlp.experts.gate_up_proj`` ``(X, 2I, E)`` as the two tensors a GGUF file holds apart
    (``ffn_gate_exps``, ``ffn_up_exps``) and the model takes: ``mlp.experts.gate_proj`` and
    ``mlp.experts.up_proj``, ``(X, I, E)`` each."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith(".experts.gate_up_proj"):
            X, two_i, E = shape
            for half in ("gate_proj", "up_proj"):
                out[name.removesuffix("gate_up_proj") + half] = (X, two_i // 2, E)
        else:
            out[name] = shape
    return _split_qkvz(cfg, out)


def _split_qkvz(cfg: DecoderConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """``shapes`` with each Gated DeltaNet's ``in_proj_qkvz`` ``(2 H_k D_k + 2 H D_v, E)`` as
    the two tensors llama.cpp's converter writes (:data:`_QWEN3_NEXT`): ``in_proj_qkv``
    ``(2 H_k D_k + H D_v, E)`` and ``in_proj_z`` ``(H D_v, E)``."""
    if cfg.model_type != "qwen3_next":
        return shapes
    out: dict[str, Any] = {}
    vd = cfg.mixer["linear_num_value_heads"] * cfg.mixer["linear_value_head_dim"]
    for name, shape in shapes.items():
        if name.endswith(".in_proj_qkvz.weight"):
            stem = name.removesuffix("qkvz.weight")
            out[stem + "qkv.weight"] = (shape[0] - vd, shape[1])
            out[stem + "z.weight"] = (vd, shape[1])
        else:
            out[name] = shape
    return out


def read_gguf(path: str | Path, options: LoadOptions | None = None, /) -> CheckpointContents:
    """Read a ``.gguf`` file: its config, weights (HF names), tokenizer and stop ids.

    ``options`` (default ``LoadOptions()``): those of :func:`portable_llm.load`. ``dtype``
    (default ``float32``) is that of the float weights, and of the scales and biases of the
    weights kept quantized. ``dequantize=True`` gives every weight as floats in
    ``dtype`` (transformers' reading); ``"auto"`` keeps a matrix quantized only where
    :func:`~portable_llm.ops.quant.keeps_codes` says its codes decode at least as fast as its
    floats on this backend, device and dtype; otherwise Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K
    matrices stay quantized, exactly, as MLX's affine format with group_size 32, and Q6_K ones
    as 8-bit codes with group_size 16 (:class:`~portable_llm.ops.quant.QuantizedWeight`).
    ``MXFP4`` tensors (gpt-oss's experts) stay :class:`~portable_llm.MXFP4Weight` unless
    ``dequantize=True``.

    Raises
    ------
    portable_llm.models.CheckpointError
        A file that is not GGUF or is truncated, a missing metadata key, an unsupported
        architecture or tensor type, missing, unexpected or misshapen tensors (all named).
    ValueError
        A dtype that is not a float dtype of the backend, or a device it does not have.
    """
    options = LoadOptions() if options is None else options
    file = Path(path)
    meta, tensors, cfg = _open(file)
    bk, target, dev = options.placement("float32")
    names, parts = _check(file, cfg, tensors)
    with np.errstate(all="ignore"):  # non-finite scales decode to inf/NaN, as in llama.cpp
        weights = {
            name: _floats(_joined_kv_b(file, tensors, g), bk, target, dev)
            if g.endswith(f"{_KV_B[0]}.weight")
            else _tensor(
                file, tensors[g], name, cfg, bk, target, dev, options.dequantize, parts.get(name)
            )
            for name, g in names.items()
        }
    tokenizer, generation = _extras(file, meta, cfg)
    return CheckpointContents(cfg, weights, bk, tokenizer, generation)


def _open(file: Path) -> tuple[GGUFMetadata, dict[str, GGUFTensor], DecoderConfig]:
    """The metadata, tensors (memory-mapped, nothing read) and config of a GGUF file."""
    if not file.is_file():
        raise FileNotFoundError(f"load: no GGUF file {str(file)!r}")
    header = read_gguf_header(file)  # every count checked against the file's size
    meta = GGUFMetadata(header.fields, file)
    return meta, header.tensors, gguf_config(meta, header.tensors)


def _extras(file: Path, meta: GGUFMetadata, cfg: DecoderConfig) -> tuple[Any, dict[str, Any]]:
    """The tokenizer and the generation config (stop and BOS ids) of a GGUF file."""
    generation: dict[str, Any] = {}
    if cfg.eos_token_id:
        generation["eos_token_id"] = list(cfg.eos_token_id)
    if cfg.bos_token_id is not None:
        generation["bos_token_id"] = cfg.bos_token_id
    with library_errors(f"{str(file)!r}: the tokenizer of its metadata (tokenizer.ggml.*)"):
        tokenizer = gguf_tokenizer(meta)
    return tokenizer, generation


class GGUFSlices:
    """A ``.gguf`` file read one tensor, or one slice of it, at a time (a rank of a
    partitioned model reads only what it holds): as float32, or with ``keep=True`` a matrix
    whose block type is affine per group (:data:`~portable_llm.checkpoint.gguf_blocks.
    AFFINE_FORMATS`) as a :class:`~portable_llm.partition.engine.QuantizedSlice` of its codes
    (what :func:`read_gguf` keeps quantized), the others dequantized.

    ``config``, ``tokenizer`` and ``generation_config`` are :func:`read_gguf`'s; ``shapes``
    maps each HF name to its full shape (checked as :func:`read_gguf` checks them);
    ``touched`` counts the bytes of the blocks read; ``size`` is the file's.
    A slice of a matrix's columns must hold whole blocks (32 values, 256 for K-quants).
    ``float16``: the reader casts to float16, so the blocks read are refused where float16
    cannot hold them, as :func:`read_gguf` refuses them (a ``CheckpointError``).
    """

    def __init__(self, path: str | Path, /, *, keep: bool = False, float16: bool = False) -> None:
        self.file, self.keep, self.float16 = Path(path), keep, float16
        meta, self.tensors, self.config = _open(self.file)
        self.names, self.parts = _check(self.file, self.config, self.tensors)
        self.shapes = gguf_shapes(self.config)
        self.tokenizer, self.generation_config = _extras(self.file, meta, self.config)
        self.touched = 0
        self.size = self.file.stat().st_size
        #: The largest block (in values) of the matrices a tensor-parallel split cuts along
        #: their columns (``o_proj``, ``down_proj``): each rank's share must hold whole blocks.
        self.column_block = max(
            BLOCK_SIZES[self.tensors[g].kind][0]
            for h, g in self.names.items()
            if h.endswith(("o_proj.weight", "down_proj.weight"))
            and self.tensors[g].kind in BLOCK_SIZES
        )

    def quantized(self, name: str) -> tuple[int, int] | None:
        """``(bits, group_size)`` of tensor ``name`` where it is read kept quantized."""
        t = self.tensors[self.names[name]]
        kind = t.kind
        if (
            self.keep
            and kind in AFFINE_FORMATS
            and len(_shape(t)) == 2
            and not float_only(self.config.model_type, name)
        ):
            return AFFINE_FORMATS[kind]
        return None

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray | QuantizedSlice:
        """Tensor ``name`` (HF name), or its slice ``index``, as float32 (or kept quantized)."""
        t = self.tensors[self.names[name]]
        if t.name.endswith(f"{_KV_B[0]}.weight"):  # DeepSeek's kv_b_proj, split in the file
            self.touched += 2 * t.data.nbytes  # (about: its two halves)
            return _joined_kv_b(self.file, self.tensors, t.name)[tuple(index)]
        kind, blocks = _blocks(self.file, t)  # a view of the memory-mapped file
        shape, part = _shape(t), self.parts.get(name, slice(None))
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if len(shape) != 2 or name.endswith(_RESHAPED):
            self.touched += blocks.nbytes
            if self.float16:
                _check_float16(self.file, t, kind, blocks)
            host = dequantize_blocks(kind, blocks).reshape(shape)[part]
            order = _row_order(name, self.config)  # a permuted q/k bias
            if order is not None:
                host = host[order]
            return _unstored(name, self.config, host)[index]
        (N, K), per = shape, BLOCK_SIZES[kind][0]
        rows = np.arange(N)[part][index[0]]
        order = _row_order(name, self.config)
        if order is not None:
            rows = order[rows]
        c0, c1, _ = index[1].indices(K)
        if c0 % per or c1 % per:
            raise ValueError(
                f"load: {self.names[name]} ({kind}) split at columns {c0}:{c1}, not along its "
                f"blocks of {per}"
            )
        held = blocks.reshape(N, K // per, -1)[rows, c0 // per : c1 // per]  # reads these only
        self.touched += held.nbytes
        if self.float16:  # the rank's blocks: each rank checks what it holds
            _check_float16(self.file, t, kind, held.reshape(-1, held.shape[-1]))
        fmt = self.quantized(name)
        if fmt is not None:  # kept quantized: the codes of whole groups
            q, scales, biases = affine_parts(kind, held.reshape(-1, held.shape[-1]))
            q, scales, biases = (a.reshape(len(rows), -1) for a in (q, scales, biases))
            return QuantizedSlice(pack_codes(q, fmt[0]), scales, biases, *fmt)
        host = dequantize_blocks(kind, held.reshape(-1, held.shape[-1]))
        return host.reshape(len(rows), c1 - c0)


def _shape(t: GGUFTensor) -> tuple[int, ...]:
    return tuple(reversed(t.shape))  # ggml's ne is innermost first


def _check(
    file: Path, cfg: DecoderConfig, tensors: dict[str, GGUFTensor]
) -> tuple[dict[str, str], dict[str, slice]]:
    """``(HF name -> GGUF name of every expected tensor, HF name -> its rows in a fused GGUF
    tensor)``; :class:`CheckpointError` listing the missing, unexpected and misshapen ones."""
    expected = gguf_shapes(cfg)
    names: dict[str, str] = {}
    parts: dict[str, slice] = {}
    fused: dict[str, tuple[int, ...]] = {}  # GGUF name -> the shape its parts imply
    unexpected = []
    family = FAMILIES.get(cfg.model_type)
    for g in tensors:
        if g in LONGROPE_TENSORS and cfg.model_type == "phi3":  # read into the config
            continue
        m = _LAYER_INDEX.match(g)
        if m and int(m[1]) >= cfg.num_hidden_layers and family and family.extra_layers:
            continue  # GLM-4.5's multi-token-prediction layer: not run (gguf_meta.mtp_layers)
        hs = hf_parts(g, cfg)
        if not hs or any(h not in expected for h in hs):
            unexpected.append(g)
            continue
        names.update(dict.fromkeys(hs, g))
        if len(hs) > 1:
            start = 0
            for h in hs:
                parts[h] = slice(start, start + expected[h][0])
                start += expected[h][0]
            fused[g] = (start, *expected[hs[0]][1:])
    split = _split_kv_b(cfg, tensors, names, fused)
    problems = []
    missing = [_gguf_name(h, layer_names(cfg)) for h in expected if h not in names]
    missing += split
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {listed(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {listed(unexpected)}")
    implied = {g: fused.get(g, _stored_shape(h, expected[h], cfg)) for h, g in names.items()}
    implied.update({g: shape for g, shape in fused.items() if g in tensors})
    bad = [
        f"{g} {_shape(tensors[g])} (metadata implies {want})"
        for g, want in implied.items()
        if g in tensors and _shape(tensors[g]) != want
    ]
    if bad:
        problems.append(f"tensors whose shape disagrees with the metadata: {listed(bad)}")
    if problems:
        raise CheckpointError(f"load: {str(file)!r}: " + "; ".join(problems))
    return {h: names[h] for h in expected}, parts


def _split_kv_b(
    cfg: DecoderConfig,
    tensors: dict[str, GGUFTensor],
    names: dict[str, str],
    implied: dict[str, tuple[int, ...]],
) -> list[str]:
    """DeepSeek's ``kv_b_proj`` as llama.cpp splits it (:data:`_KV_B`): each such HF name
    maps to its ``attn_k_b`` (``names``), both halves' shapes go to ``implied``; the halves
    missing their partner are returned."""
    missing = []
    for h, g in names.items():
        m = _BLK.match(g)
        if not (m and m[2] in _KV_B):
            continue
        k_b, v_b = (f"blk.{m[1]}.{half}.weight" for half in _KV_B)
        H, R, dn, dv = (cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                        cfg.v_head_dim)  # fmt: skip
        implied.update({k_b: (H, R, dn), v_b: (H, dv, R)})
        missing += [half for half in (k_b, v_b) if half not in tensors]
        names[h] = k_b
    return missing


def _joined_kv_b(file: Path, tensors: dict[str, GGUFTensor], k_b: str) -> np.ndarray:
    """HF's ``kv_b_proj`` ``(H (d_n + d_v), R)`` from llama.cpp's ``attn_k_b`` ``(H, R, d_n)``
    and ``attn_v_b`` ``(H, d_v, R)`` (dequantized): each head's key rows, then its value rows."""
    halves = []
    for g in (k_b, k_b.replace(_KV_B[0], _KV_B[1])):
        kind, blocks = _blocks(file, tensors[g])
        halves.append(dequantize_blocks(kind, blocks).reshape(_shape(tensors[g])))
    return join_kv_b(*halves)


def _stored_shape(h: str, shape: tuple[int, ...], cfg: DecoderConfig) -> tuple[int, ...]:
    """The shape a GGUF file stores of HF's tensor ``h`` of ``shape`` (:data:`_RESHAPED`)."""
    if h.endswith(_SQUEEZED):
        return (shape[0], shape[2])
    if h.endswith((".mamba.A_log", ".mamba.D")):
        return (shape[0], 1)
    if h.endswith(".mamba.norm.weight"):
        G = cfg.mixer["n_groups"]
        return (G, shape[0] // G)
    return shape


def _gguf_name(h: str, layer: dict[str, str]) -> str:
    """The GGUF name of an HF tensor name (for messages)."""
    for g, stem in _GLOBAL.items():
        for suffix in ("weight", "bias"):
            if h == f"{stem}.{suffix}":
                return f"{g}.{suffix}"
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", h)
    if m:
        for g, stem in layer.items():
            if stem == m[2]:
                return f"blk.{m[1]}.{g}.{m[3]}"
    m = re.match(r"^model\.layers\.(\d+)\.([\w.]+)$", h)
    for g, stem in _BARE.items():
        if m and stem == m[2]:
            return f"blk.{m[1]}.{g}"
    if m:
        for g, stem in _UNSUFFIXED.items():
            if stem == m[2]:
                return f"blk.{m[1]}.{g}.weight"
            if stem.removesuffix("_proj") + "_bias" == m[2]:
                return f"blk.{m[1]}.{g}.bias"
    return h


def _blocks(file: Path, t: GGUFTensor) -> tuple[str, np.ndarray]:
    """``(type name, uint8 blocks (n, bytes per block))`` of a tensor, checked."""
    kind = t.kind
    if kind not in BLOCK_SIZES:
        raise CheckpointError(
            f"load: {str(file)!r}: tensor {t.name} has GGUF type {kind}, which portable_llm "
            f"does not read; supported: {', '.join(BLOCK_SIZES)}"
        )
    per, nbytes = BLOCK_SIZES[kind]
    want = t.n_elements // per * nbytes
    if t.data.size != want or t.n_elements % per or _shape(t)[-1] % per:
        raise CheckpointError(
            f"load: {str(file)!r}: tensor {t.name} ({kind}, shape {_shape(t)}) has "
            f"{t.data.size} bytes, expected {want} (truncated file?)"
        )
    return kind, t.data.reshape(-1, nbytes)


def _floats(host: np.ndarray, bk: Backend, dtype: Any, device: Any) -> Any:
    """Float32 host values as ``bk``'s array of ``dtype`` on ``device`` (cast there)."""
    arr = bk.from_numpy(np.ascontiguousarray(host, dtype=np.float32), device)
    return arr if arr.dtype == dtype else bk.astype(arr, dtype)


def _check_float16(file: Path, t: GGUFTensor, kind: str, blocks: np.ndarray) -> None:
    """Refuse a tensor float16 cannot hold (:func:`~portable_llm.checkpoint.gguf_blocks.
    float16_overflow`), whether it would be kept quantized or dequantized: the two forms
    overflow in different places (a kept group's scale, a dequantized weight), so neither
    could be the rule; saturating would change the weights silently, and float32 scales under
    a float16 model would need mixed-dtype kernels on every backend."""
    over = float16_overflow(kind, blocks)
    if over is not None:
        what, size = over
        raise CheckpointError(
            f"load: {str(file)!r}: tensor {t.name} ({kind}) has {what} up to {size:.6g}, past "
            "float16's largest (65504): as float16 it would hold infinities; load it with "
            "dtype='bfloat16' or dtype='float32'"
        )


def _unstored(name: str, cfg: DecoderConfig, host: np.ndarray) -> np.ndarray:
    """A float tensor as HF holds it: llama.cpp stores Gemma's norm weights as ``1 + w``
    (transformers' ``Gemma2TensorProcessor`` subtracts the 1; the decoder adds it back)."""
    if cfg.model_type in _PLUS_ONE_TYPES and name.endswith("norm.weight"):
        return host if name.endswith(_PLAIN_NORM) else host - np.float32(1.0)
    if name.endswith(_SQUEEZED):  # (E, K) -> (E, 1, K)
        return host[:, None, :]
    if name.endswith((".mamba.A_log", ".linear_attn.A_log")):  # A = -exp(A_log): (H, 1), (H,)
        return np.log(-host).reshape(-1)
    if name.endswith(_RESHAPED):  # D (H, 1); the gated norm (G, I / G)
        return host.reshape(-1)
    return host


def _row_order(name: str, cfg: DecoderConfig) -> np.ndarray | None:
    """The rows that undo llama.cpp's q/k permutation (transformers' ``_reverse_permute``), of
    the weights and the biases alike."""
    qk = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
    if cfg.model_type not in _PERMUTED_TYPES or not name.endswith(qk):
        return None
    heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
    half = cfg.head_dim // 2
    return np.arange(heads * 2 * half).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


def _tensor(
    file: Path,
    t: GGUFTensor,
    name: str,
    cfg: DecoderConfig,
    bk: Backend,
    dtype: Any,
    device: Any,
    dequantize: bool | str,
    part: slice | None = None,
) -> Any:
    kind, blocks = _blocks(file, t)
    shape = _shape(t)
    if bk.dtype_name(dtype) == "float16":
        _check_float16(file, t, kind, blocks)
    rows = _row_order(name, cfg)
    if part is not None:  # a block of a fused tensor's rows (none is permuted)
        rows = np.arange(shape[0])[part]
        shape = (len(rows), *shape[1:])
    if dequantize == "auto" and kind in AFFINE_FORMATS and len(shape) == 2:
        # ops.quant's measured rule: keep the codes only where they decode at least as fast
        from portable_llm.ops.quant import device_kind, keeps_codes

        where = device_kind(bk, bk.from_numpy(np.zeros(1, np.float32), device))
        bits, group = AFFINE_FORMATS[kind]
        fmt = {"bits": bits, "group_size": group, "rows": shape[0]}
        dequantize = not keeps_codes(bk, device=where, dtype=bk.dtype_name(dtype), **fmt)
    if kind == "MXFP4" and dequantize is not True:  # gpt-oss's experts: kept (as a folder's)
        from portable_llm.checkpoint.mxfp4 import mxfp4_from_ggml

        return mxfp4_from_ggml(blocks, shape, dtype=bk.dtype_name(dtype), backend=bk, device=device)
    if (
        dequantize
        or kind not in AFFINE_FORMATS
        or len(shape) != 2
        or name.endswith(_RESHAPED)
        or float_only(cfg.model_type, name)  # cut by the family's reader with array operations
    ):
        host = _unstored(name, cfg, dequantize_blocks(kind, blocks).reshape(_shape(t)))
        if rows is not None:
            host = host[rows]
        return _floats(host, bk, dtype, device)
    q, scales, biases = affine_parts(kind, blocks)
    N, K = _shape(t)
    bits, group = AFFINE_FORMATS[kind]
    q, scales, biases = q.reshape(N, K), scales.reshape(N, -1), biases.reshape(N, -1)
    if rows is not None:
        q, scales, biases = q[rows], scales[rows], biases[rows]
    from portable_llm.ops.quant import QuantizedWeight

    return QuantizedWeight(
        bk.from_numpy(pack_codes(q, bits), device),
        _floats(scales, bk, dtype, device),
        _floats(biases, bk, dtype, device),
        bits=bits,
        group_size=group,
    )
