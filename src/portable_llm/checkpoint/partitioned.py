"""A checkpoint read by one rank of a partitioned model: its own tensors and slices only.

:func:`read_partitioned` reads the headers and the config (as
:func:`~portable_llm.checkpoint.folder.read_folder` does), lets the engine plan the split (a
bad group is a ``ValueError`` before any weight is read), then reads each tensor this process
holds, or only its rank's slice of it, with safetensors' ``get_slice`` over the memory-mapped
files (:class:`~portable_llm.checkpoint.weights.SliceReader`), or only the blocks it holds
from a memory-mapped ``.gguf`` file (:class:`~portable_llm.checkpoint.gguf.GGUFSlices`); an
mlx-lm quantized folder's codes, scales and biases along whole groups
(:class:`~portable_llm.checkpoint.quantized_slices.QuantizedSlices`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from portable_llm.backends import Backend, numpy_bfloat16
from portable_llm.checkpoint.build import LoadOptions
from portable_llm.checkpoint.config import read_config, read_model_type
from portable_llm.checkpoint.folder import read_generation_config
from portable_llm.checkpoint.gguf import GGUFSlices
from portable_llm.checkpoint.quantized import read_quantization, stored_dtype
from portable_llm.checkpoint.quantized_slices import QuantizedSlices
from portable_llm.checkpoint.shards import SafetensorsFiles
from portable_llm.checkpoint.tokenizer import read_tokenizer
from portable_llm.checkpoint.weights import SliceReader
from portable_llm.decoder.model import Model
from portable_llm.partition.build import build_partitioned
from portable_llm.partition.engine import Engine, QuantizedSlice

__all__ = ["LoadReport", "read_partitioned"]


class LoadReport:
    """What one process read: ``held`` (bytes of the weights it holds, on every device it
    drives), ``touched`` (bytes of the file spans it read), ``total`` (bytes of every weight
    at the load dtype) and ``file`` (bytes of the weight files)."""

    def __init__(self, held: int, touched: int, total: int, file: int) -> None:
        self.held, self.touched, self.total, self.file = held, touched, total, file

    def __repr__(self) -> str:
        return (
            f"LoadReport(held={self.held / self.total:.2f}x of the weights, "
            f"touched={self.touched / self.file:.2f}x of the files)"
        )


def read_partitioned(
    path: str | Path, options: LoadOptions, engine: Engine, /
) -> tuple[Model, LoadReport]:
    """The model of this process's share of the checkpoint folder (float or mlx-lm quantized)
    or ``.gguf`` file ``path``, its quantized weights kept as ``options.dequantize`` says
    (whole groups per rank), and what it read."""
    source = Path(path)
    deq = options.dequantize
    if source.suffix == ".gguf" and not source.is_dir():
        bk, target, dev = options.placement("float32")
        float16 = bk.dtype_name(target) == "float16"  # blocks float16 cannot hold: refused
        gguf = GGUFSlices(source, keep=deq is not True, float16=float16)  # True: floats
        engine.plans(gguf.config, gguf.column_block)  # a bad group fails before any read
        return _build(engine, gguf, gguf, bk, target, dev, gguf.size, gguf.column_block, deq)
    if not source.is_dir():
        raise FileNotFoundError(f"load: {str(path)!r} is not a folder")
    read_model_type(source)  # no config.json, or another family: said before anything else
    quant = read_quantization(source)  # mlx-lm's quantized folders (None: floats)
    with SafetensorsFiles(source) as st:
        cfg = read_config(source, layers=st.layers, experts=st.experts)
        if quant is None:
            reader: SliceReader | QuantizedSlices = SliceReader(st, cfg)
            group = None
        else:  # kept quantized, each rank's share cut along whole groups
            reader = QuantizedSlices(st, cfg, quant)
            group = reader.group_size
        engine.plans(cfg, group)  # a bad group fails here, before the weights are read
        bk, target, dev = options.placement(stored_dtype(st, "model.embed_tokens.weight"))
        extras = _Extras(cfg, read_tokenizer(source), read_generation_config(source))
        files = sum(f.stat().st_size for f in set(st.files.values()))
        return _build(engine, reader, extras, bk, target, dev, files, group, deq)


class _Extras:
    def __init__(self, config: Any, tokenizer: Any, generation_config: dict[str, Any]) -> None:
        self.config, self.tokenizer, self.generation_config = config, tokenizer, generation_config


def _build(
    engine: Engine,
    reader: Any,
    extras: Any,
    bk: Backend,
    target: Any,
    dev: Any,
    files: int,
    group_size: int | None,
    dequantize: bool | str,
) -> tuple[Model, LoadReport]:
    """Build the model over ``reader`` (``shapes``, ``read(name, index)``, ``touched``), with
    ``extras``' ``config``, ``tokenizer`` and ``generation_config``."""
    host = _host_dtype(bk, target)
    held = 0

    def read(name: str, index: tuple[slice, ...]) -> np.ndarray | QuantizedSlice:
        nonlocal held
        out = reader.read(name, index)
        if isinstance(out, QuantizedSlice):  # the scales and biases in the load dtype
            out = out._replace(scales=out.scales.astype(host), biases=out.biases.astype(host))
        elif out.dtype != host:
            out = out.astype(host)
        held += out.nbytes
        return out

    model = build_partitioned(
        engine, extras.config, reader.shapes, read, bk, target, dev,
        group_size=group_size, dequantize=dequantize,
        tokenizer=extras.tokenizer, generation_config=extras.generation_config,
    )  # fmt: skip
    itemsize = np.dtype(host).itemsize
    total = sum(_nbytes(reader, name, itemsize) for name in reader.shapes)
    return model, LoadReport(held, reader.touched, total, files)


def _nbytes(reader: Any, name: str, itemsize: int) -> int:
    """The bytes of tensor ``name`` as one process would hold it (kept quantized or not)."""
    shape = reader.shapes[name]
    fmt = reader.quantized(name)
    if fmt is None:
        return int(np.prod(shape)) * itemsize
    (bits, group), rows, K = fmt, int(np.prod(shape[:-1])), shape[-1]
    return rows * (K * bits // 8 + 2 * (K // group) * itemsize)


def _host_dtype(bk: Backend, target: Any) -> Any:
    name = bk.dtype_name(target)
    return numpy_bfloat16() if name == "bfloat16" else np.dtype(name)
