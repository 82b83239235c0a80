"""Reading a checkpoint's ``model.safetensors`` (or its shards) into a backend's arrays.

:class:`~portable_llm.checkpoint.shards.SafetensorsFiles` opens the files (every path checked to lie
inside the folder) and reads their headers only; a file that is not valid safetensors is a
:class:`CheckpointError` naming it. Every tensor is checked against the config *before* any data
is read: the names the config implies, with their shapes and a float dtype, against the headers.
Then each tensor is read on its own (safetensors memory-maps the file; NumPy holds one tensor at
a time, bfloat16 as ml_dtypes') and handed to the backend, so the model is never held twice in
memory.

Names are HF transformers' (``model.layers.0.self_attn.q_proj.weight``). Stacked experts are HF
v5's (``mlp.experts.gate_up_proj`` ``(X, 2I, E)``, ``mlp.experts.down_proj`` ``(X, E, I)``),
also read from the per-expert layout that ``save_pretrained`` writes by default and Hub
checkpoints hold (``mlp.experts.{e}.gate_proj.weight``; Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2.weight``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from portable_llm.backends import FLOAT_DTYPES, Backend, numpy_bfloat16
from portable_llm.checkpoint.files import CheckpointError, listed
from portable_llm.checkpoint.gpt2_layout import (
    GPT2_IGNORED,
    Derived,
    gpt2_sources,
    llama4_sources,
    phi3_sources,
)
from portable_llm.checkpoint.gpt_oss_layout import Mxfp4Source, gpt_oss_sources
from portable_llm.checkpoint.mxfp4 import mxfp4_from_blocks
from portable_llm.checkpoint.shards import INDEX, SAFETENSORS_FLOATS, SafetensorsFiles
from portable_llm.decoder.config import DecoderConfig
from portable_llm.decoder.families import FAMILIES
from portable_llm.decoder.families.base import mlp_tensors

__all__ = [
    "CheckpointError",
    "SafetensorsFiles",
    "SliceReader",
    "expected_shapes",
    "family_name",
    "read_weights",
    "read_span",
    "to_backend",
]


# Tensors some checkpoints carry that the model recomputes, or that transformers does not read
# either (Qwen3-Next's multi-token-prediction head ``mtp.*``): never reported as unexpected.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$|^mtp\.")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_LEGACY_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight$")


def expected_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by HF name, with the shape the config implies.

    MoE layers list their experts stacked (HF v5 ``gate_up_proj``/``down_proj``).
    """
    E, V, D = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    H, H_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, E)}
    if cfg.position_embedding == "learned":  # GPT-2's wpe
        out["model.embed_positions.weight"] = (cfg.max_position_embeddings or 0, E)
    biased = cfg.norm == "layer" and cfg.norm_bias  # LayerNorm: a bias too (not Cohere 2's)
    norms = ("weight", "bias") if biased else ("weight",)
    layer_norms = ["input_layernorm", "post_attention_layernorm"]
    if cfg.parallel_block:  # Phi-2, Cohere 2: one norm feeds attention and MLP
        layer_norms = ["input_layernorm"]
    if cfg.sandwich_norms:  # Gemma: the MLP's input and output normed too
        layer_norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if cfg.post_norms:  # OLMo 2: the outputs of attention and MLP only
        layer_norms = ["post_attention_layernorm", "post_feedforward_layernorm"]
    q_norm, k_norm = ((H * D,), (H_kv * D,)) if cfg.qk_norm_whole else ((D,), (D,))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind in norms:
            for norm in layer_norms:
                out[p + f"{norm}.{kind}"] = (E,)
        for name, rows in (("q", H * D), ("k", H_kv * D), ("v", H_kv * D)):
            out[p + f"self_attn.{name}_proj.weight"] = (rows, E)
            if cfg.qkv_bias:
                out[p + f"self_attn.{name}_proj.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (E, H * D)
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = (E,)
        if cfg.qk_norm:  # per head (Qwen3), or over all heads (OLMo 2)
            out[p + "self_attn.q_norm.weight"] = q_norm
            out[p + "self_attn.k_norm.weight"] = k_norm
        if cfg.moe_layers[i]:
            X, I_m = cfg.num_experts, cfg.moe_intermediate_size
            out[p + "mlp.gate.weight"] = (X, E)
            out[p + "mlp.experts.gate_up_proj"] = (X, 2 * I_m, E)
            out[p + "mlp.experts.down_proj"] = (X, E, I_m)
        else:
            mlp_tensors(out, p + "mlp.", E, cfg.intermediate_size, cfg.mlp_bias, cfg.gated_mlp)
        family = FAMILIES.get(cfg.model_type)
        if family is not None and family.tensors is not None:  # what the family changes
            family.tensors(cfg, i, out)
    for kind in norms:
        out[f"model.norm.{kind}"] = (E,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, E)
    if cfg.lm_head_bias:
        out["lm_head.bias"] = (V,)
    return out


def family_name(model_type: str, name: str) -> str:
    """A checkpoint tensor's name in the decoder's (Llama's) vocabulary: the ``names`` of the
    family's :class:`~portable_llm.decoder.families.Family` (Phi-2's ``dense``, ``fc1``,
    ``fc2`` and ``final_layernorm`` renamed)."""
    family = FAMILIES.get(model_type)
    for old, new in family.names if family else ():
        if old in name:
            return name.replace(old, new)
    return name


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _layer_index(name: str) -> int:
    """The decoder layer a tensor belongs to (``model.layers.{i}.``), else -1."""
    m = _LAYER.match(name)
    return int(m[1]) if m else -1


def _canonical(name: str) -> str:
    """A file's name in HF v5 layout (Mixtral's ``block_sparse_moe``/``w1`` names renamed)."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    m = re.match(r"^(.*\.experts\.\d+)\.(w[123])\.weight$", name)
    return f"{m[1]}.{_MIXTRAL_EXPERT[m[2]]}.weight" if m else name


class _Sources:
    """Where each expected tensor comes from: one file tensor, or per-expert pieces to stack."""

    def __init__(self, cfg: DecoderConfig, files: dict[str, Path]) -> None:
        self.expected = expected_shapes(cfg)
        self.files = files
        self.direct: dict[str, str] = {}  # expected name -> file name
        self.pieces: dict[str, dict[tuple[int, str], str]] = {}  # "...experts" -> (e, proj)
        self.unexpected: list[str] = []
        #: expected name -> (file name, its shape, transform): a tensor cut from another
        #: (GPT-2's fused, transposed Conv1D weights; gpt2_layout).
        self.derived: dict[str, Derived] = {}
        #: expected name -> its MXFP4 ``*_blocks``/``*_scales`` pair (gpt-oss's experts).
        self.mxfp4: dict[str, Mxfp4Source] = {}
        if cfg.model_type == "gpt2":
            table = gpt2_sources(cfg, files)
            self.derived = {k: v for k, v in table.items() if v[0] in files}
            used = {v[0] for v in table.values()}
            self.unexpected = [
                f for f in files
                if f not in used and not GPT2_IGNORED.match(f)
                and not (f == "lm_head.weight" and cfg.tie_word_embeddings)
            ]  # fmt: skip
            files = {}
        elif cfg.model_type in ("phi3", "llama4_text"):  # the fused tensors cut; others below
            table = (phi3_sources if cfg.model_type == "phi3" else llama4_sources)(cfg, files)
            self.derived = {k: v for k, v in table.items() if v[0] in files}
            used = {v[0] for v in table.values()}
            files = {f: path for f, path in files.items() if f not in used}
        elif cfg.model_type == "gpt_oss":  # interleaved, transposed experts; or MXFP4 ones
            table, self.mxfp4 = gpt_oss_sources(cfg, files)
            self.derived = {k: v for k, v in table.items() if v[0] in files}
            used = {v[0] for v in table.values()}
            used |= {f for m in self.mxfp4.values() for f in (m.blocks, m.scales)}
            files = {f: path for f, path in files.items() if f not in used}
        family = FAMILIES.get(cfg.model_type)
        extra = family is not None and family.extra_layers  # DeepSeek V3's MTP layers
        for file_name in files:
            name = _canonical(family_name(cfg.model_type, file_name))
            m = _LEGACY_EXPERT.match(name)
            if extra and _layer_index(name) >= cfg.num_hidden_layers:
                continue  # a layer transformers does not run either
            if name in self.expected:
                self.direct[name] = file_name
            elif m and m[1] + ".down_proj" in self.expected and m[3] in ("gate", "up", "down"):
                self.pieces.setdefault(m[1], {})[int(m[2]), m[3]] = file_name
            elif not _IGNORED.match(name) and not (
                name == "lm_head.weight" and cfg.tie_word_embeddings
            ):
                self.unexpected.append(file_name)
        self.num_experts = cfg.num_experts

    def missing(self) -> list[str]:
        """Expected tensors with no source; per-expert pieces by name when some are there."""
        out = []
        for name in self.expected:
            stem, _, proj = name.rpartition(".")
            if name in self.direct or name in self.derived:
                continue
            if name in self.mxfp4:
                out += [f for f in self.mxfp4[name][:2] if f not in self.files]
                continue
            got = self.pieces.get(stem) if stem.endswith(".experts") else None
            if got is None:
                out.append(name)  # the stacked tensor (or any other) itself
                continue
            kinds = ("gate", "up") if proj == "gate_up_proj" else ("down",)
            out += [
                f"{stem}.{e}.{k}_proj.weight"
                for e in range(self.num_experts)
                for k in kinds
                if (e, k) not in got
            ]
        return out

    def extra_pieces(self) -> list[str]:
        """Per-expert pieces with an expert index beyond num_experts."""
        return [
            f for pieces in self.pieces.values() for (e, _), f in pieces.items()
            if e >= self.num_experts
        ]  # fmt: skip


def _check(src: _Sources, st: SafetensorsFiles) -> None:
    """Raise :class:`CheckpointError` listing every problem; the tensors the shard index maps
    to a file that lacks them are reported once, not as missing."""
    problems = []
    if st.misplaced:
        shown = [f"{name} (not in {file})" for name, file in st.misplaced.items()]
        problems.append(
            f"{INDEX} maps tensors to shards that lack them ({len(shown)}): {listed(shown)}"
        )
    reported = {_canonical(name) for name in st.misplaced}
    missing = [name for name in src.missing() if name not in reported]
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {listed(missing)}")
    unexpected = src.unexpected + src.extra_pieces()
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {listed(unexpected)}")
    bad, kinds = [], []
    used = [(st.shapes[f], src.expected[name], f) for name, f in src.direct.items()]
    used += list({(st.shapes[f], shape, f) for f, shape, _ in src.derived.values()})
    for stem, pieces in src.pieces.items():
        _, two_i, E = src.expected[stem + ".gate_up_proj"]
        want_piece = {"gate": (two_i // 2, E), "up": (two_i // 2, E), "down": (E, two_i // 2)}
        used += [(st.shapes[f], want_piece[kind], f) for (_, kind), f in sorted(pieces.items())]
    for m in {m[:3] for m in src.mxfp4.values()}:  # (blocks, scales, blocks' shape)
        for f, want in ((m[0], m[2]), (m[1], m[2][:-1])):
            if f in st.shapes and st.shapes[f] != want:
                bad.append(f"{f} {st.shapes[f]} (config implies {want})")
            if f in st.dtypes and st.dtypes[f] != "U8":
                kinds.append(f"{f} ({st.dtypes[f]}, MXFP4's are U8)")
    for got, want, file_name in used:
        if got != want:
            bad.append(f"{file_name} {got} (config implies {want})")
        if st.dtypes[file_name] not in SAFETENSORS_FLOATS:
            kinds.append(f"{file_name} ({st.dtypes[file_name]})")
    if bad:
        problems.append(
            f"tensors whose shape disagrees with config.json ({len(bad)}): {listed(bad)}"
        )
    if kinds:
        problems.append(
            f"tensors that are not float ({', '.join(SAFETENSORS_FLOATS)}) ({len(kinds)}): "
            f"{listed(kinds)}"
        )
    if problems:
        raise CheckpointError(f"load: checkpoint {str(st.folder)!r}: " + "; ".join(problems))


def read_weights(
    path: str | Path | SafetensorsFiles,
    cfg: DecoderConfig,
    bk: Backend,
    dtype: Any,
    device: Any = None,
) -> dict[str, Any]:
    """Check the checkpoint in ``path`` against ``cfg``, then read it into ``bk``'s arrays.

    ``path``: the folder, or its :class:`SafetensorsFiles` already open. Returns a dict from
    the names of :func:`expected_shapes` to arrays of ``dtype`` on ``device`` (the backend's
    default when ``None``), except that each ``mlp.experts.gate_up_proj`` comes split in its
    halves, ``mlp.experts.gate_proj`` and ``mlp.experts.up_proj`` ``(X, I, E)``. Raises
    :class:`CheckpointError` listing every missing, unexpected, misshapen or non-float tensor,
    and every tensor that the shard index maps to a file without it.
    """
    if not isinstance(path, SafetensorsFiles):
        with SafetensorsFiles(path) as st:
            return read_weights(st, cfg, bk, dtype, device)
    st = path
    src = _Sources(cfg, {n: f for n, f in st.files.items() if n not in st.misplaced})
    _check(src, st)
    out = {
        name: to_backend(name, host, bk, kept_dtype(bk, name, dtype), device)
        for name, host in _host_tensors(src, st.read)
    }
    for name, m in src.mxfp4.items():  # gpt-oss's experts, kept quantized
        blocks, scales = st.read(m.blocks)[:, m.rows], st.read(m.scales)[:, m.rows]
        out[name] = mxfp4_from_blocks(
            blocks, scales, dtype=bk.dtype_name(dtype), backend=bk, device=device
        )
    return out


#: Tensors a narrower float model keeps in float32, as transformers keeps them
#: (``_keep_in_fp32_modules_strict``): the grouped router's correction bias, which decides the
#: experts (DeepSeek V3, GLM-4.5).
KEEP_FLOAT32 = (".e_score_correction_bias",)


def kept_dtype(bk: Backend, name: str, dtype: Any) -> Any:
    """The dtype tensor ``name`` is read in: ``dtype``, or float32 for the tensors of
    :data:`KEEP_FLOAT32` when ``dtype`` is narrower (bfloat16, float16)."""
    if name.endswith(KEEP_FLOAT32) and bk.dtype_name(dtype) in ("bfloat16", "float16"):
        return bk.xp.float32
    return dtype


def _host_tensors(
    src: _Sources, read: Callable[[str], np.ndarray]
) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, numpy array)`` for every expected tensor, one at a time."""
    for name in src.expected:
        stem, _, proj = name.rpartition(".")
        if name in src.mxfp4:  # read_weights reads them as MXFP4Weight
            continue
        if proj == "gate_up_proj":  # split, so the backend never holds the fused tensor
            if name in src.direct:
                fused = read(src.direct[name])  # (X, 2I, E)
                half = fused.shape[1] // 2
                gate, up = (
                    np.ascontiguousarray(fused[:, :half]),
                    np.ascontiguousarray(fused[:, half:]),
                )
                del fused
                yield stem + ".gate_proj", gate
                yield stem + ".up_proj", up
            else:
                for kind in ("gate", "up"):
                    yield (
                        f"{stem}.{kind}_proj",
                        _stack(src.pieces[stem], kind, src.num_experts, read),
                    )
        elif name in src.direct:
            yield name, read(src.direct[name])
        elif name in src.derived:
            file_name, _, cut = src.derived[name]
            yield name, cut(read(file_name))
        else:
            yield name, _stack(src.pieces[stem], "down", src.num_experts, read)  # (X, E, I)


def _stack(
    pieces: dict[tuple[int, str], str], kind: str, n: int, read: Callable[[str], np.ndarray]
) -> np.ndarray:
    return np.stack([read(pieces[e, kind]) for e in range(n)])  # (X, I, E) or (X, E, I)


def to_backend(name: str, host: np.ndarray, bk: Backend, dtype: Any, device: Any) -> Any:
    """The backend's array in ``dtype`` on ``device``: cast there, or on the host when the
    device lacks the stored dtype (bfloat16 on array-api-strict, float64 on JAX without x64 or
    on an MPS or MLX GPU)."""
    stored = "bfloat16" if host.dtype == numpy_bfloat16() else host.dtype.name
    if stored not in FLOAT_DTYPES:
        raise CheckpointError(f"load: {name} is stored as {host.dtype}, not a float dtype")
    if stored not in bk.float_dtypes(device):
        name = bk.dtype_name(dtype)
        host = host.astype(numpy_bfloat16() if name == "bfloat16" else np.dtype(name))
    arr = bk.from_numpy(host, device)
    return arr if arr.dtype == dtype else bk.astype(arr, dtype)


class SliceReader:
    """Any tensor :func:`read_weights` gives, or one slice of it, read alone from the files (a
    rank of a partitioned model reads only what it holds).

    ``st``: the files, open; ``cfg``: the config they are checked against at once (as
    :func:`read_weights` checks them: :class:`CheckpointError` listing every problem).
    ``shapes`` maps the names :func:`read_weights` returns (stacked experts' ``gate_up_proj``
    as ``gate_proj`` and ``up_proj``) to their full shapes; ``touched`` counts the bytes of the
    file spans the reads covered (a slice's first to last byte, per tensor read).
    """

    def __init__(self, st: SafetensorsFiles, cfg: DecoderConfig) -> None:
        self.st = st
        self.src = _Sources(cfg, {n: f for n, f in st.files.items() if n not in st.misplaced})
        _check(self.src, st)
        if self.src.mxfp4:
            raise CheckpointError(
                f"load: checkpoint {str(st.folder)!r}: MXFP4 experts (gpt-oss's *_blocks and "
                "*_scales) are not read per rank: a partitioned model needs float experts"
            )
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in self.src.expected.items():
            stem, _, proj = name.rpartition(".")
            if proj == "gate_up_proj":
                X, two_i, E = shape
                self.shapes[stem + ".gate_proj"] = self.shapes[stem + ".up_proj"] = (
                    X, two_i // 2, E,
                )  # fmt: skip
            else:
                self.shapes[name] = shape
        self.touched = 0

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """Tensor ``name`` (a key of :attr:`shapes`), or its slice ``index``."""
        index = tuple(index) + (slice(None),) * (len(self.shapes[name]) - len(index))
        stem, _, proj = name.rpartition(".")
        if name in self.src.direct:
            return self._read(self.src.direct[name], index)
        if name in self.src.derived:  # cut from a fused tensor (GPT-2), read whole
            file_name, _, cut = self.src.derived[name]
            full = self._read(file_name, (slice(None),) * len(self.st.shapes[file_name]))
            return np.ascontiguousarray(cut(full)[index])
        if proj in ("gate_proj", "up_proj") and stem + ".gate_up_proj" in self.src.direct:
            fused = self.src.direct[stem + ".gate_up_proj"]  # (X, 2I, E)
            half = self.shapes[name][1]
            rows = range(half)[index[1]]
            start = rows.start + (half if proj == "up_proj" else 0)
            stop = start + len(rows)
            return self._read(fused, (index[0], slice(start, stop), index[2]))
        kind = proj.removesuffix("_proj")
        experts = range(self.src.num_experts)[index[0]]
        pieces = self.src.pieces[stem]
        return np.stack([self._read(pieces[e, kind], index[1:]) for e in experts])

    def quantized(self, name: str) -> None:
        """A float folder's tensors are never quantized (:class:`~portable_llm.checkpoint.
        quantized_slices.QuantizedSlices` reads the quantized ones)."""
        return None

    def _read(self, file_name: str, index: tuple[slice, ...]) -> np.ndarray:
        out, self.touched = read_span(self.st, file_name, index, self.touched)
        return out


def read_span(
    st: SafetensorsFiles, name: str, index: tuple[slice, ...], touched: int = 0
) -> tuple[np.ndarray, int]:
    """Slice ``index`` (one ``slice`` per dimension) of tensor ``name`` of the open files, and
    ``touched`` plus the bytes of the file span it covers (its first to last byte)."""
    shape = st.shapes[name]
    out = st.read(name, index)
    if out.size:
        first = [range(n)[s][0] for n, s in zip(shape, index, strict=True)]
        last = [range(n)[s][-1] for n, s in zip(shape, index, strict=True)]
        span = np.ravel_multi_index(last, shape) - np.ravel_multi_index(first, shape) + 1
        touched += int(span) * out.itemsize
    return out, touched
