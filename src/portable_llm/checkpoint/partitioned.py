"""A checkpoint read by one rank of a partitioned model: its own tensors and slices only.

:func:`read_partitioned` reads the headers and the config (as
:func:`~portable_llm.checkpoint.folder.read_folder` does), lets the engine plan the split (a
bad group is a ``ValueError`` before any weight is read), then reads each tensor this process
holds, or only its rank's slice of it, with safetensors' ``get_slice`` over the memory-mapped
files (:class:`~portable_llm.checkpoint.weights.SliceReader`), or only the blocks it holds
from a memory-mapped ``.gguf`` file (:class:`~portable_llm.checkpoint.gguf.GGUFSlices`,
dequantized).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from portable_llm.backends import Backend, numpy_bfloat16
from portable_llm.checkpoint.build import LoadOptions
from portable_llm.checkpoint.config import config_path, read_config
from portable_llm.checkpoint.folder import read_generation_config
from portable_llm.checkpoint.gguf import GGUFSlices
from portable_llm.checkpoint.quantized import read_quantization, stored_dtype
from portable_llm.checkpoint.shards import SafetensorsFiles
from portable_llm.checkpoint.tokenizer import read_tokenizer
from portable_llm.checkpoint.weights import SliceReader
from portable_llm.decoder.model import Model
from portable_llm.partition.build import build_partitioned
from portable_llm.partition.engine import Engine

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
    """The model of this process's share of the checkpoint folder or ``.gguf`` file ``path``
    (a GGUF file's weights dequantized to ``dtype``), and what it read."""
    source = Path(path)
    if source.suffix == ".gguf" and not source.is_dir():
        gguf = GGUFSlices(source)
        engine.plans(gguf.config, gguf.column_block)  # a bad group fails before any read
        bk, target, dev = options.placement("float32")
        return _build(engine, gguf, gguf, bk, target, dev, gguf.size, gguf.column_block)
    if not source.is_dir():
        raise FileNotFoundError(f"load: {str(path)!r} is not a folder")
    config_path(source)
    if read_quantization(source) is not None:
        raise ValueError(
            "load: tensor_parallel/pipeline_parallel of an mlx-lm quantized folder is not "
            "supported yet; load it whole, or a float checkpoint"
        )
    with SafetensorsFiles(source) as st:
        cfg = read_config(source, layers=st.layers, experts=st.experts)
        engine.plans(cfg)  # a bad group fails here, before the weights are read
        bk, target, dev = options.placement(stored_dtype(st, "model.embed_tokens.weight"))
        reader = SliceReader(st, cfg)
        extras = _Extras(cfg, read_tokenizer(source), read_generation_config(source))
        files = sum(f.stat().st_size for f in set(st.files.values()))
        return _build(engine, reader, extras, bk, target, dev, files, None)


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
) -> tuple[Model, LoadReport]:
    """Build the model over ``reader`` (``shapes``, ``read(name, index)``, ``touched``), with
    ``extras``' ``config``, ``tokenizer`` and ``generation_config``."""
    host = _host_dtype(bk, target)
    held = 0

    def read(name: str, index: tuple[slice, ...]) -> np.ndarray:
        nonlocal held
        out = reader.read(name, index)
        out = out if out.dtype == host else out.astype(host)
        held += out.nbytes
        return out

    model = build_partitioned(
        engine, extras.config, reader.shapes, read, bk, target, dev,
        group_size=group_size,
        tokenizer=extras.tokenizer, generation_config=extras.generation_config,
    )  # fmt: skip
    itemsize = np.dtype(host).itemsize
    total = sum(int(np.prod(s)) for s in reader.shapes.values()) * itemsize
    return model, LoadReport(held, reader.touched, total, files)


def _host_dtype(bk: Backend, target: Any) -> Any:
    name = bk.dtype_name(target)
    return numpy_bfloat16() if name == "bfloat16" else np.dtype(name)
