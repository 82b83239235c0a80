"""Where each tensor the decoder needs lies in an mlx-lm quantized folder, family by family.

mlx-lm converts a checkpoint into its own model's names, then quantizes every ``Linear`` and
``Embedding`` whose input width the group size divides. Most families keep HF's names; these
do not:

- ``phi`` (Phi-2): ``self_attn.dense``, ``mlp.fc1``/``fc2``, ``model.final_layernorm``, and
  ``starcoder2``: ``mlp.c_fc``/``c_proj`` (HF's names, renamed by
  :func:`~portable_llm.checkpoint.weights.family_name` as for a float folder);
- ``deepseek_v3``: ``kv_b_proj`` ``(H (d_n + d_v), R)`` split by mlx-lm's ``sanitize`` into
  ``self_attn.embed_q`` ``(H, R, d_n)`` (each head's key rows, transposed) and
  ``self_attn.unembed_out`` ``(H, d_v, R)``, each quantized alone: joined back at load
  (:func:`join_kv_b`; llama.cpp's ``attn_k_b``/``attn_v_b`` are the same split);
- ``qwen3_next``: the convolution likewise; the norms' scales ``1 + w`` (mlx-lm's ``sanitize``
  adds the 1; its model is the plain RMSNorm), read back as ``w``;
- ``lfm2``: the convolution ``conv.conv.weight`` in MLX's ``Conv1d`` layout ``(E, K, 1)``, HF's
  ``(E, 1, K)`` transposed;
- ``phi3``: the fused ``self_attn.qkv_proj`` and ``mlp.gate_up_proj``, quantized whole: q, k and
  v (gate and up) are row ranges of one stored module;
- ``gpt2``: mlx-lm's ``model.wte``, ``model.wpe``, ``model.h.{i}.attn.c_attn`` (q, k, v as row
  ranges, weight and bias), ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``, ``ln_1``, ``ln_2``,
  ``model.ln_f``, its Conv1D weights already transposed to ``Linear``'s ``(out, in)`` at
  conversion, and ``model.wpe`` quantized as an embedding.

A quantized module's rows are output rows of its codes, scales and biases alike, so a row range
of a fused module is a quantized weight of its own, cut without dequantizing.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import numpy as np

from portable_llm.checkpoint.weights import family_name
from portable_llm.decoder.config import DecoderConfig

__all__ = ["JOINED", "Stored", "join_kv_b", "stored_tensors"]

#: The families' short convolutions, stored by mlx-lm in MLX's ``Conv1d`` layout.
_MLX_CONV = {"lfm2": ".conv.conv.weight", "qwen3_next": ".linear_attn.conv1d.weight"}
#: The norms whose ``1 + w`` scale mlx-lm's ``qwen3_next`` stores (not the gated DeltaNet's).
_PLUS_ONE_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)

#: The suffixes of the two stored halves of a joined tensor (:func:`join_kv_b`), appended to
#: the model's name in :func:`stored_tensors`' table.
JOINED = ("#k_b", "#v_b")


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """DeepSeek's ``kv_b_proj`` ``(H (d_n + d_v), R)`` from its halves as mlx-lm and llama.cpp
    store them: ``k_b`` ``(H, R, d_n)`` (each head's key rows, transposed) and ``v_b``
    ``(H, d_v, R)``; each head's key rows, then its value rows."""
    joined = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)  # (H, d_n + d_v, R)
    return joined.reshape(-1, joined.shape[-1])


class Stored(NamedTuple):
    """Where one of the decoder's tensors lies: the stored tensor's name (``p.weight`` of a
    quantized module ``p``, or a float tensor) and shape (dequantized), the row range the
    tensor takes of it (``None``: all of it), and the stored axes in the decoder's order
    (``numpy.transpose``'s; ``None``: as stored; a float tensor's only)."""

    name: str
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None
    axes: tuple[int, ...] | None = None
    offset: float = 0.0  # stored = the decoder's + offset (a float tensor's only)


#: mlx-lm's ``gpt_oss`` names of a MoE layer's tensors (after ``.mlp.``; its ``sanitize`` cuts
#: HF's interleaved ``gate_up_proj`` and its bias into gate and up, as the model takes them).
_GPT_OSS = {
    "gate.weight": "router.weight",
    "gate.bias": "router.bias",
    **{f"experts.{p}_proj": f"experts.{p}_proj.weight" for p in ("gate", "up", "down")},
    **{f"experts.{p}_bias": f"experts.{p}_proj.bias" for p in ("gate", "up", "down")},
}


def _gpt_oss(expected: dict[str, tuple[int, ...]]) -> dict[str, Stored]:
    """Where mlx-lm's ``gpt_oss`` folder holds a MoE layer's tensors (:data:`_GPT_OSS`): its
    experts ``(X, N, K)`` as the model takes them (MXFP4, ``Quantization.is_mxfp4``)."""
    out = {}
    for name, shape in expected.items():
        base, _, leaf = name.rpartition(".mlp.")
        if leaf in _GPT_OSS:
            out[name] = Stored(f"{base}.mlp.{_GPT_OSS[leaf]}", shape)
    return out


def stored_tensors(
    cfg: DecoderConfig, expected: dict[str, tuple[int, ...]], files: Collection[str]
) -> dict[str, Stored]:
    """For each of ``expected``'s names (the decoder's, with their shapes), where it lies in the
    folder's tensors ``files`` (mlx-lm's names; the stacked experts are read by the caller)."""
    if cfg.model_type == "gpt2":
        return _gpt2(cfg, expected, files)
    renamed = {family_name(cfg.model_type, f): f for f in files}  # Phi-2's, StarCoder2's names
    out = {name: Stored(renamed.get(name, name), shape) for name, shape in expected.items()}
    conv = _MLX_CONV.get(cfg.model_type)
    if conv is not None:  # MLX's Conv1d weight (out, K, in): HF's (C, 1, K) transposed
        for name, shape in expected.items():
            if name.endswith(conv):
                C, _, K = shape
                out[name] = Stored(name, (C, K, 1), axes=(0, 2, 1))
    if cfg.model_type == "qwen3_next":  # mlx-lm stores its (1 + w) norms' scales
        for name, (stored, shape, _, _, _) in list(out.items()):
            if name.endswith(_PLUS_ONE_NORMS) and len(shape) == 1:
                out[name] = Stored(stored, shape, offset=1.0)
    if cfg.model_type == "gpt_oss":
        out.update(_gpt_oss(expected))
    if cfg.model_type == "deepseek_v3":  # kv_b_proj: two stored halves, joined at load
        H, R = cfg.num_attention_heads, cfg.kv_lora_rank
        dn, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
        for name in [n for n in out if n.endswith("self_attn.kv_b_proj.weight")]:
            a = name.removesuffix("kv_b_proj.weight")
            del out[name]
            out[name + JOINED[0]] = Stored(a + "embed_q.weight", (H, R, dn))
            out[name + JOINED[1]] = Stored(a + "unembed_out.weight", (H, dv, R))
    if cfg.model_type == "phi3":
        E, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741
        q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = (f"{p}self_attn.qkv_proj.weight", (q + 2 * kv, E))
            for n, rows in (("q", (0, q)), ("k", (q, q + kv)), ("v", (q + kv, q + 2 * kv))):
                out[f"{p}self_attn.{n}_proj.weight"] = Stored(*qkv, rows)
            fused = (f"{p}mlp.gate_up_proj.weight", (2 * I, E))  # HF Phi3MLP: chunk(2)
            out[f"{p}mlp.gate_proj.weight"] = Stored(*fused, (0, I))
            out[f"{p}mlp.up_proj.weight"] = Stored(*fused, (I, 2 * I))
    return out


def _gpt2(
    cfg: DecoderConfig, expected: dict[str, tuple[int, ...]], files: Collection[str]
) -> dict[str, Stored]:
    pre = next((p for p in ("model.", "transformer.") if p + "wte.weight" in files), "")
    out = {
        "model.embed_tokens.weight": f"{pre}wte.weight",
        "model.embed_positions.weight": f"{pre}wpe.weight",
        "model.norm.weight": f"{pre}ln_f.weight",
        "model.norm.bias": f"{pre}ln_f.bias",
        "lm_head.weight": "lm_head.weight",
    }
    E = cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        h, p = f"{pre}h.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            out[f"{p}input_layernorm.{kind}"] = f"{h}ln_1.{kind}"
            out[f"{p}post_attention_layernorm.{kind}"] = f"{h}ln_2.{kind}"
            for ours, theirs in (("self_attn.o", "attn.c_proj"), ("mlp.up", "mlp.c_fc"),
                                 ("mlp.down", "mlp.c_proj")):  # fmt: skip
                out[f"{p}{ours}_proj.{kind}"] = f"{h}{theirs}.{kind}"
    table = {name: Stored(out[name], shape) for name, shape in expected.items() if name in out}
    for i in range(cfg.num_hidden_layers):  # q, k, v: rows of c_attn, weight and bias
        p, c_attn = f"model.layers.{i}.self_attn.", f"{pre}h.{i}.attn.c_attn."
        for j, n in enumerate("qkv"):
            rows = (j * E, (j + 1) * E)
            table[f"{p}{n}_proj.weight"] = Stored(c_attn + "weight", (3 * E, E), rows)
            table[f"{p}{n}_proj.bias"] = Stored(c_attn + "bias", (3 * E,), rows)
    return table
