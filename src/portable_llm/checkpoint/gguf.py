"""GGUF files (llama.cpp's format) as a :class:`~portable_llm.models.Model`.

Read with the ``gguf`` package's ``GGUFReader`` (the file is memory-mapped; one tensor is
decoded at a time):

- the metadata (``{arch}.block_count``, ``{arch}.attention.head_count``, ...) becomes a
  :class:`~portable_llm.models.DecoderConfig`, through the same ``from_dict`` as ``config.json``;
- the tensors (``blk.{i}.attn_q.weight``, ...) get HF's names (``model.layers.{i}.self_attn.
  q_proj.weight``); for the ``llama`` architecture, the rows of ``attn_q``/``attn_k`` that
  llama.cpp's converter permuted for its rotary layout are put back (as transformers does);
- quantized tensors stay quantized (:class:`~portable_llm.ops.quant.QuantizedWeight`, MLX's
  affine layout) where the block type is exactly affine per group of 32
  (:data:`~portable_llm.checkpoint.gguf_blocks.AFFINE_BITS`), and are dequantized otherwise, or
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
from portable_llm.checkpoint.files import CheckpointError
from portable_llm.checkpoint.gguf_blocks import (
    AFFINE_BITS,
    BLOCK_SIZES,
    affine_parts,
    dequantize_blocks,
    pack_codes,
)
from portable_llm.checkpoint.gguf_tokenizer import gguf_tokenizer
from portable_llm.checkpoint.weights import expected_shapes
from portable_llm.decoder.config import DecoderConfig

__all__ = [
    "GGUF_ARCHITECTURES",
    "gguf_config",
    "gguf_tokenizer",
    "read_gguf",
]

#: The ``general.architecture`` values :func:`load_gguf` reads. llama.cpp writes Mistral
#: (7B, Nemo) models as ``llama``; there is no ``mistral`` architecture in GGUF.
GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
# llama.cpp's LlamaModel converter (its Mistral subclass too) permutes q/k rows; Qwen's do not.
_PERMUTED = ("llama",)
_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
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
}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(name: str) -> str | None:
    """HF's name of a GGUF tensor (``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.
    q_proj.weight``), or ``None`` for a name outside the decoder's vocabulary."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL and suffix == "weight":
        return f"{_GLOBAL[stem]}.weight"
    m = _BLK.match(name)
    if m and m[2] in _LAYER:
        return f"model.layers.{m[1]}.{_LAYER[m[2]]}.{m[3]}"
    return None


class _Meta:
    """The metadata of a reader, with errors that name the file and the key."""

    def __init__(self, reader: Any, file: Path) -> None:
        self.fields = reader.fields
        self.file = file

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        if key not in self.fields:
            raise CheckpointError(f"load: {str(self.file)!r}: GGUF metadata key {key} is missing")
        return self.get(key)


def gguf_config(meta: _Meta, tensors: dict[str, Any]) -> DecoderConfig:
    """The :class:`DecoderConfig` a GGUF file's metadata describes (transformers' reading)."""
    arch = meta.need("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"load: {str(meta.file)!r}: unsupported GGUF architecture {arch!r} "
            f"(general.architecture); supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is None and arch in _PERMUTED:
        head_dim = meta.get(f"{arch}.rope.dimension_count")
    embed = tensors.get("token_embd.weight")
    vocab = int(embed.shape[1]) if embed is not None else meta.get(f"{arch}.vocab_size")
    d: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": meta.need(f"{arch}.embedding_length"),
        "intermediate_size": meta.need(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.need(f"{arch}.block_count"),
        "num_attention_heads": meta.need(f"{arch}.attention.head_count"),
        "num_key_value_heads": _one(meta, f"{arch}.attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": meta.need(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": meta.get(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids(meta),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        d["rope_scaling"] = {
            "rope_type": "linear",
            "factor": meta.need(f"{arch}.rope.scaling.factor"),
        }
    elif scaling != "none":
        raise CheckpointError(
            f"load: {str(meta.file)!r}: {arch}.rope.scaling.type {scaling!r} is not supported "
            "(none, linear)"
        )
    try:
        return DecoderConfig.from_dict(d)
    except ValueError as exc:
        raise CheckpointError(f"load: {str(meta.file)!r}: GGUF metadata: {exc}") from None


def _one(meta: _Meta, key: str) -> int | None:
    """A count that some files store per layer: the one value, or an error if they differ."""
    value = meta.get(key)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise CheckpointError(
                f"load: {str(meta.file)!r}: {key} differs between layers ({value}); not supported"
            )
        value = value[0]
    return None if value is None else int(value)


def eos_ids(meta: _Meta) -> list[int]:
    """The ids that end a turn: ``tokenizer.ggml.eos_token_id`` (then ``eot``, ``eom``)."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def read_gguf(path: str | Path, options: LoadOptions | None = None, /) -> CheckpointContents:
    """Read a ``.gguf`` file: its config, weights (HF names), tokenizer and stop ids.

    ``options`` (default ``LoadOptions()``): those of :func:`portable_llm.load`. ``dtype``
    (default ``float32``) is that of the float weights, and of the scales and biases of the
    weights kept quantized. ``dequantize=True`` gives every weight as floats in
    ``dtype`` (transformers' reading); otherwise Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K
    matrices stay quantized, exactly, as MLX's affine format with group_size 32
    (:class:`~portable_llm.ops.quant.QuantizedWeight`).

    Raises
    ------
    portable_llm.models.CheckpointError
        A file that is not GGUF or is truncated, a missing metadata key, an unsupported
        architecture or tensor type, missing, unexpected or misshapen tensors (all named).
    ValueError
        A dtype that is not a float dtype of the backend, or a device it does not have.
    """
    from gguf import GGUFReader

    options = LoadOptions() if options is None else options
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"load: no GGUF file {str(file)!r}")
    try:
        reader = GGUFReader(file, "r")
    except (ValueError, OSError, KeyError, IndexError) as exc:
        size = file.stat().st_size if file.is_file() else 0
        raise CheckpointError(
            f"load: {str(file)!r} ({size} bytes) is not a readable GGUF file: {exc} "
            "(a truncated file, or not GGUF)"
        ) from None
    meta = _Meta(reader, file)
    tensors = {t.name: t for t in reader.tensors}
    cfg = gguf_config(meta, tensors)
    bk, target, dev = options.placement("float32")
    names = _check(file, cfg, tensors)
    weights = {
        name: _tensor(file, tensors[g], name, cfg, bk, target, dev, options.dequantize)
        for name, g in names.items()
    }
    generation: dict[str, Any] = {}
    if cfg.eos_token_id:
        generation["eos_token_id"] = list(cfg.eos_token_id)
    if cfg.bos_token_id is not None:
        generation["bos_token_id"] = cfg.bos_token_id
    return CheckpointContents(cfg, weights, bk, gguf_tokenizer(meta), generation)


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(t.shape))  # ggml's ne is innermost first


def _check(file: Path, cfg: DecoderConfig, tensors: dict[str, Any]) -> dict[str, str]:
    """HF name -> GGUF name of every expected tensor; :class:`CheckpointError` listing the
    missing, unexpected and misshapen ones."""
    expected = expected_shapes(cfg)
    names: dict[str, str] = {}
    unexpected = []
    for g in tensors:
        h = hf_name(g)
        if h is None or h not in expected:
            unexpected.append(g)
        else:
            names[h] = g
    problems = []
    missing = [_gguf_name(h) for h in expected if h not in names]
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected)}")
    bad = [
        f"{g} {_shape(tensors[g])} (metadata implies {expected[h]})"
        for h, g in names.items()
        if _shape(tensors[g]) != expected[h]
    ]
    if bad:
        problems.append(f"tensors whose shape disagrees with the metadata: {', '.join(bad)}")
    if problems:
        raise CheckpointError(f"load: {str(file)!r}: " + "; ".join(problems))
    return {h: names[h] for h in expected}


def _gguf_name(h: str) -> str:
    """The GGUF name of an HF tensor name (for messages)."""
    for g, stem in _GLOBAL.items():
        if h == f"{stem}.weight":
            return f"{g}.weight"
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", h)
    if m:
        for g, stem in _LAYER.items():
            if stem == m[2]:
                return f"blk.{m[1]}.{g}.{m[3]}"
    return h


def _blocks(file: Path, t: Any) -> tuple[str, np.ndarray]:
    """``(type name, uint8 blocks (n, bytes per block))`` of a tensor, checked."""
    kind = t.tensor_type.name
    if kind not in BLOCK_SIZES:
        raise CheckpointError(
            f"load: {str(file)!r}: tensor {t.name} has GGUF type {kind}, which portable_llm "
            f"does not read; supported: {', '.join(BLOCK_SIZES)}"
        )
    per, nbytes = BLOCK_SIZES[kind]
    raw = np.asarray(t.data).reshape(-1).view(np.uint8)
    want = int(t.n_elements) // per * nbytes
    if raw.size != want or int(t.n_elements) % per or _shape(t)[-1] % per:
        raise CheckpointError(
            f"load: {str(file)!r}: tensor {t.name} ({kind}, shape {_shape(t)}) has "
            f"{raw.size} bytes, expected {want} (truncated file?)"
        )
    return kind, raw.reshape(-1, nbytes)


def _floats(host: np.ndarray, bk: Backend, dtype: Any, device: Any) -> Any:
    """Float32 host values as ``bk``'s array of ``dtype`` on ``device`` (cast there)."""
    arr = bk.from_numpy(np.ascontiguousarray(host, dtype=np.float32), device)
    return arr if arr.dtype == dtype else bk.astype(arr, dtype)


def _row_order(name: str, cfg: DecoderConfig) -> np.ndarray | None:
    """The rows that undo llama.cpp's q/k permutation (transformers' ``_reverse_permute``)."""
    if cfg.model_type not in _PERMUTED or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return None
    heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
    half = cfg.head_dim // 2
    return np.arange(heads * 2 * half).reshape(heads, half, 2).swapaxes(1, 2).reshape(-1)


def _tensor(
    file: Path,
    t: Any,
    name: str,
    cfg: DecoderConfig,
    bk: Backend,
    dtype: Any,
    device: Any,
    dequantize: bool,
) -> Any:
    kind, blocks = _blocks(file, t)
    shape = _shape(t)
    rows = _row_order(name, cfg)
    if dequantize or kind not in AFFINE_BITS or len(shape) != 2:
        host = dequantize_blocks(kind, blocks).reshape(shape)
        if rows is not None:
            host = host[rows]
        return _floats(host, bk, dtype, device)
    q, scales, biases = affine_parts(kind, blocks)
    N, K = shape
    q, scales, biases = q.reshape(N, K), scales.reshape(N, K // 32), biases.reshape(N, K // 32)
    if rows is not None:
        q, scales, biases = q[rows], scales[rows], biases[rows]
    bits = AFFINE_BITS[kind]
    from portable_llm.ops.quant import QuantizedWeight

    return QuantizedWeight(
        bk.from_numpy(pack_codes(q, bits), device),
        _floats(scales, bk, dtype, device),
        _floats(biases, bk, dtype, device),
        bits=bits,
        group_size=32,
    )
