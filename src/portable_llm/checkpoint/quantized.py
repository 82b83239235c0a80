"""mlx-lm's quantized checkpoint folders (``mlx_lm.convert(quantize=True)``, the Hub's
``*-MLX-4bit`` models), read with their weights kept quantized.

Such a folder is an HF folder whose ``config.json`` has ``"quantization": {"group_size": 64,
"bits": 4, "mode": "affine"}``, optionally with per-layer entries keyed by the module's path
(``"model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8}``, or ``false`` for a layer left
in floats). Each quantized module ``p`` stores ``p.weight`` (uint32 codes, ``(N, K * bits / 32)``),
``p.scales`` and ``p.biases`` (``(N, K / group_size)``): MLX's affine format, which
:class:`~portable_llm.ops.quant.QuantizedWeight` holds as is, on any backend. Biases of a layer
(``q_proj.bias``) and norms stay float tensors. A module in ``"mode": "mxfp4"`` (gpt-oss's
experts as mlx-lm converts OpenAI's checkpoint; 4 bits, groups of 32) stores ``p.weight``
(uint32 words of eight E2M1 codes) and ``p.scales`` (uint8 E8M0 exponents), no biases: read as
:class:`~portable_llm.MXFP4Weight`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from portable_llm.backends import Backend
from portable_llm.checkpoint.config import config_path
from portable_llm.checkpoint.files import CheckpointError, listed, read_json
from portable_llm.checkpoint.mlx_layout import JOINED, Stored, join_kv_b, stored_tensors
from portable_llm.checkpoint.shards import SAFETENSORS_FLOATS, SafetensorsFiles
from portable_llm.checkpoint.weights import expected_shapes, to_backend
from portable_llm.decoder.config import DecoderConfig
from portable_llm.ops.quant import BITS, GROUP_SIZES, QuantizedWeight, fastest_form
from portable_llm.ops.quant import dequantize as dequantize_weight
from portable_llm.ops.quant.mxfp4 import MXFP4Weight

__all__ = [
    "FAMILY_FLOAT_ONLY",
    "FLOAT_ONLY",
    "Entry",
    "Quantization",
    "check_quantized",
    "float_only",
    "host_values",
    "read_quantization",
    "read_quantized_weights",
    "stored_dtype",
]


#: Tensors mlx-lm may quantize that the model takes as floats, dequantized at load: GPT-2's
#: position table (``model.wpe``, ``(P, E)``: small, added to every row of a forward).
FLOAT_ONLY: frozenset[str] = frozenset({"model.embed_positions.weight"})
#: The matrices a family's layer reader takes as arrays, not quantized weights (it cuts them
#: with array operations): read as floats whatever ``dequantize``. Qwen3-Next's
#: ``in_proj_qkvz``/``in_proj_ba`` (``split_qkvz``, ``split_ba``) and its gated ``q_proj``
#: (``split_gated_q_proj``).
FAMILY_FLOAT_ONLY: dict[str, tuple[str, ...]] = {
    "qwen3_next": (".in_proj_qkvz.weight", ".in_proj_ba.weight", ".self_attn.q_proj.weight"),
}


def float_only(model_type: str, name: str) -> bool:
    """Whether the model's tensor ``name`` is read as floats whatever ``dequantize``
    (:data:`FLOAT_ONLY`, :data:`FAMILY_FLOAT_ONLY`)."""
    return name in FLOAT_ONLY or name.endswith(FAMILY_FLOAT_ONLY.get(model_type, ("\0",)))


class Entry(NamedTuple):
    """One of the model's tensors in a quantized folder: the stored tensor (``p.weight`` of a
    quantized module ``p``, whose ``p.scales`` and ``p.biases`` come with it, or a float
    tensor), the model tensor's (dequantized) shape, its ``(bits, group_size)`` (``None``: a
    float tensor), the stored rows it takes (``None``: all; a fused module's part), and the
    stored axes in the model's order (``None``: as stored; :class:`~portable_llm.checkpoint.
    mlx_layout.Stored`)."""

    stored: str
    shape: tuple[int, ...]
    fmt: tuple[int, int] | None
    rows: tuple[int, int] | None = None
    axes: tuple[int, ...] | None = None
    parts: tuple[Entry, Entry] | None = None  # a tensor joined from two (mlx_layout.JOINED)
    offset: float = 0.0  # a float tensor stored as the model's + offset (mlx_layout.Stored)


class Quantization:
    """A folder's ``"quantization"``: the default ``(bits, group_size)`` and per-module ones
    (``None`` for a module left in floats), and the modules in MLX's ``mode="mxfp4"``
    (gpt-oss's experts as mlx-lm converts OpenAI's checkpoint: :meth:`is_mxfp4`)."""

    def __init__(
        self, bits: int, group_size: int, layers: dict[str, tuple[int, int] | None],
        mode: str = "affine", modes: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.bits, self.group_size, self.layers = bits, group_size, layers
        self.mode, self.modes = mode, modes or {}

    def is_mxfp4(self, module: str) -> bool:
        """Whether module ``module`` is stored in MLX's MXFP4 layout (``uint32`` words of eight
        E2M1 codes, one ``uint8`` E8M0 exponent per 32 values, no biases)."""
        return self.modes.get(module, self.mode) == "mxfp4"

    def of(self, module: str) -> tuple[int, int] | None:
        """``(bits, group_size)`` of module ``module`` (``"model.layers.0.mlp.down_proj"``)."""
        return self.layers.get(module, (self.bits, self.group_size))


def _format(where: str, entry: Any) -> tuple[int, int]:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where} must be an object with bits and group_size, got {entry!r}")
    mode = entry.get("mode", "affine")
    bits, group = entry.get("bits"), entry.get("group_size")
    if mode == "mxfp4" and (bits, group) != (4, 32):
        raise CheckpointError(f"{where}: mode 'mxfp4' needs bits=4, group_size=32")
    if mode not in ("affine", "mxfp4"):
        raise CheckpointError(f"{where}: mode {mode!r} is not supported ('affine', 'mxfp4')")
    if type(bits) is not int or bits not in BITS:  # 4.0 == 4, but a float is not a bit count
        raise CheckpointError(f"{where}: bits must be one of {BITS}, got {bits!r}")
    if type(group) is not int or group not in GROUP_SIZES:
        raise CheckpointError(f"{where}: group_size must be one of {GROUP_SIZES}, got {group!r}")
    return bits, group


def read_quantization(path: str | Path, /) -> Quantization | None:
    """The ``"quantization"`` entry of a folder's ``config.json``; ``None`` when it has none.

    Raises :class:`CheckpointError` naming ``config.json`` for a mode other than ``"affine"``,
    or bits/group_size that MLX's affine format does not have.
    """
    file = config_path(path)
    q = read_json(file).get("quantization")
    if q is None:
        return None
    where = f"load: {str(file)!r}: quantization"
    bits, group = _format(where, q)
    layers: dict[str, tuple[int, int] | None] = {}
    modes: dict[str, str] = {}
    for key, entry in q.items():
        if key in ("bits", "group_size", "mode"):
            continue
        if entry is False:
            layers[key] = None
        elif isinstance(entry, dict):
            entry = {"mode": "affine", **entry}  # MLX's to_quantized's default, not q's mode
            layers[key] = _format(f"{where}[{key!r}]", entry)
            modes[key] = entry["mode"]
    return Quantization(bits, group, layers, q.get("mode", "affine"), modes)


def stored_dtype(st: SafetensorsFiles, name: str) -> str | None:
    """The float dtype of tensor ``name``, or of its scales when it is quantized."""
    stem = name.removesuffix(".weight")
    return st.stored_dtype(stem + ".scales" if stem + ".scales" in st.dtypes else name)


def read_quantized_weights(
    st: SafetensorsFiles,
    cfg: DecoderConfig,
    bk: Backend,
    dtype: Any,
    device: Any,
    quant: Quantization,
    *,
    dequantize: bool | str = False,
) -> dict[str, Any]:
    """Check an mlx-lm quantized folder against ``cfg``, then read it into ``bk``'s arrays.

    Returns the names of :func:`~portable_llm.checkpoint.weights.expected_shapes`, each a float
    array in ``dtype`` or, for a quantized module, a :class:`QuantizedWeight` whose scales and
    biases are in ``dtype`` (their stored dtype by default). Raises :class:`CheckpointError`
    listing every missing, unexpected or misshapen tensor. MoE layers are read from mlx-lm's
    stacked experts (``switch_mlp.{gate,up,down}_proj``, ``(X, N, K * bits / 32)``) as the
    stacked ``mlp.experts.{gate,up,down}_proj`` that the float loader gives.
    The names of :data:`FLOAT_ONLY` and :data:`FAMILY_FLOAT_ONLY` are dequantized whatever
    ``dequantize``.
    ``dequantize="auto"``: a quantized module is kept only where
    :func:`~portable_llm.ops.quant.keeps_codes` says its codes decode at least as fast as its
    floats (:func:`~portable_llm.ops.quant.fastest_form`), else given as ``dequantize``'s floats.
    """
    out: dict[str, Any] = {}
    last: tuple[str, np.ndarray] | None = None  # a fused module's parts follow each other

    def read(name: str, rows: tuple[int, int] | None) -> np.ndarray:
        nonlocal last
        if last is None or last[0] != name:
            last = (name, st.read(name))
        return last[1] if rows is None else np.ascontiguousarray(last[1][rows[0] : rows[1]])

    for out_name, (name, _, fmt, rows, axes, parts, offset) in check_quantized(
        st, cfg, quant
    ).items():
        if parts is not None:  # DeepSeek's kv_b_proj: its two halves, dequantized, joined
            host = join_kv_b(*(host_values(st.read, e) for e in parts))
            out[out_name] = to_backend(out_name, host, bk, dtype, device)
            continue
        if fmt is None:
            host = read(name, rows)
            if axes is not None:  # (LFM2's convolution in MLX's layout)
                host = np.ascontiguousarray(host.transpose(axes))
            if offset:  # (Qwen3-Next's norms: mlx-lm stores 1 + w)
                host = host - np.asarray(offset, dtype=host.dtype)
            out[out_name] = to_backend(name, host, bk, dtype, device)
            continue
        stem = name.removesuffix(".weight")
        codes = read(name, rows)
        if quant.is_mxfp4(stem):  # gpt-oss's experts: kept as MXFP4 unless dequantize=True
            words, exps = (bk.from_numpy(a, device) for a in (codes, read(stem + ".scales", rows)))
            mx = MXFP4Weight(words, exps, dtype=bk.dtype_name(dtype))
            out[out_name] = dequantize_weight(mx) if dequantize is True else mx
            continue
        scales = to_backend(stem + ".scales", read(stem + ".scales", rows), bk, dtype, device)
        biases = to_backend(stem + ".biases", read(stem + ".biases", rows), bk, dtype, device)
        qw = QuantizedWeight(
            bk.from_numpy(codes, device), scales, biases, bits=fmt[0], group_size=fmt[1]
        )
        if float_only(cfg.model_type, out_name):
            out[out_name] = dequantize_weight(qw)
        else:
            out[out_name] = fastest_form(qw) if dequantize == "auto" else qw
    return out


def check_quantized(
    st: SafetensorsFiles, cfg: DecoderConfig, quant: Quantization
) -> dict[str, Entry]:
    """Check an mlx-lm quantized folder against ``cfg`` (:class:`CheckpointError` listing every
    missing, unexpected or misshapen tensor), reading headers only. Returns an :class:`Entry`
    for each of the model's tensors, by the model's name (mlx-lm's stacked experts: see
    :func:`read_quantized_weights`; the families' own names and fused modules:
    :mod:`~portable_llm.checkpoint.mlx_layout`)."""
    problems: list[str] = []
    entries: dict[str, Entry] = {}
    checked: dict[str, tuple[int, int] | None] = {}  # stored name -> its format, checked once
    used: set[str] = set()
    for out_name, (name, shape, rows, axes, offset) in _stored_names(st, cfg).items():
        stem = name.removesuffix(".weight")
        if name in checked:
            entries[out_name] = Entry(name, _cut(shape, rows), checked[name], rows)
            continue
        fmt = quant.of(stem) if name.endswith(".weight") else None
        if name.endswith(".weight") and stem + ".scales" in st.files and fmt is not None:
            bits, group = fmt
            lead, k = shape[:-1], shape[-1]  # (X, N) for stacked experts, else (N,)
            want = {
                name: ((*lead, k * bits // 32), ("U32",)),
                stem + ".scales": ((*lead, k // group), tuple(SAFETENSORS_FLOATS)),
                stem + ".biases": ((*lead, k // group), tuple(SAFETENSORS_FLOATS)),
            }
            if quant.is_mxfp4(stem):  # E8M0 exponents, no biases
                want = {name: want[name], stem + ".scales": ((*lead, k // group), ("U8",))}
            for part, (pshape, kinds) in want.items():
                if part not in st.shapes:
                    problems.append(f"missing {part}")
                    continue
                used.add(part)
                if st.shapes[part] != pshape or st.dtypes[part] not in kinds:
                    problems.append(
                        f"{part} {st.shapes[part]} {st.dtypes[part]} (a {shape} weight at "
                        f"bits={bits}, group_size={group} implies {pshape} {'/'.join(kinds)})"
                    )
        elif name in st.shapes:
            fmt = None
            used.add(name)
            if st.shapes[name] != shape or st.dtypes[name] not in SAFETENSORS_FLOATS:
                problems.append(f"{name} {st.shapes[name]} {st.dtypes[name]} (expected {shape})")
        elif not (out_name == "lm_head.weight" and cfg.tie_word_embeddings):
            problems.append(f"missing {name}")
            continue
        else:
            continue
        checked[name] = fmt
        if axes is not None:  # a float tensor stored in another axis order
            entries[out_name] = Entry(name, tuple(shape[a] for a in axes), None, None, axes)
            continue
        if offset and fmt is None:  # a float tensor stored with an offset
            entries[out_name] = Entry(name, shape, None, offset=offset)
            continue
        entries[out_name] = Entry(name, _cut(shape, rows), fmt, rows)
    for out_name in [n for n in entries if n.endswith(JOINED[0])]:
        whole = out_name.removesuffix(JOINED[0])
        parts = (entries.pop(out_name), entries.pop(whole + JOINED[1]))
        H, R, dn = parts[0].shape
        entries[whole] = Entry(whole, (H * (dn + parts[1].shape[1]), R), None, parts=parts)
    unexpected = [
        n for n in st.files if n not in used and not n.endswith(".rotary_emb.inv_freq")
        and not (n.startswith("lm_head.") and cfg.tie_word_embeddings)
    ]  # fmt: skip
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {listed(unexpected)}")
    if problems:
        raise CheckpointError(
            f"load: quantized checkpoint {str(st.folder)!r}: {listed(problems, sep='; ')}"
        )
    return entries


def host_values(read: Any, entry: Entry) -> np.ndarray:
    """A whole stored tensor's values as float32 NumPy: a quantized module's codes times its
    scales plus its biases (MLX's affine format), or a float tensor as it is."""
    if entry.fmt is None:
        return np.asarray(read(entry.stored), dtype=np.float32)
    from portable_llm.ops.quant.codes import unpack_codes

    bits, group = entry.fmt
    stem = entry.stored.removesuffix(".weight")
    codes = unpack_codes(np, np.asarray(read(entry.stored)), bits=bits).astype(np.float32)
    scales, biases = (np.asarray(read(stem + k), dtype=np.float32) for k in (".scales", ".biases"))
    grouped = codes.reshape(*codes.shape[:-1], -1, group)  # (.., K / group, group)
    return (grouped * scales[..., None] + biases[..., None]).reshape(codes.shape)


def _cut(shape: tuple[int, ...], rows: tuple[int, int] | None) -> tuple[int, ...]:
    return shape if rows is None else (rows[1] - rows[0], *shape[1:])


def _stored_names(st: SafetensorsFiles, cfg: DecoderConfig) -> dict[str, Stored]:
    """Where each of the model's tensors lies (:func:`~portable_llm.checkpoint.mlx_layout.
    stored_tensors`), by the model's name.

    mlx-lm stores a MoE layer's experts stacked per projection, ``switch_mlp.gate_proj`` and
    ``switch_mlp.up_proj`` ``(X, I, E)`` and ``switch_mlp.down_proj`` ``(X, E, I)``, under the
    module of its own model (``mlp.`` for Qwen2-MoE, ``block_sparse_moe.`` for Mixtral, whose
    router is ``block_sparse_moe.gate``); the model takes them as ``mlp.experts.gate_proj``,
    ``mlp.experts.up_proj`` and ``mlp.experts.down_proj`` (the float loader's split of HF's
    ``gate_up_proj``).
    """
    out: dict[str, Stored] = {}
    for name, where in stored_tensors(cfg, expected_shapes(cfg), st.files).items():
        shape = where.shape
        base, _, leaf = name.rpartition(".mlp.")
        module = base + ".mlp."
        if where.name == name and leaf in (
            "experts.gate_up_proj",
            "experts.down_proj",
            "gate.weight",
        ):
            moe = base + ".block_sparse_moe."
            stored = moe if moe + "gate.weight" in st.files else module  # Mixtral's module name
            if leaf == "gate.weight":
                out[name] = Stored(stored + "gate.weight", shape)
            elif leaf == "experts.down_proj":
                out[name] = Stored(stored + "switch_mlp.down_proj.weight", shape)
            else:
                x, two_i, e = shape
                for proj in ("gate", "up"):
                    stacked = stored + f"switch_mlp.{proj}_proj.weight"
                    out[module + f"experts.{proj}_proj"] = Stored(stacked, (x, two_i // 2, e))
            continue
        out[name] = where
    return out
