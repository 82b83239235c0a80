"""A checkpoint folder read by one rank of a partitioned model: its own tensors and slices only.

:func:`read_partitioned` reads the headers and the config (as
:func:`~portable_llm.checkpoint.folder.read_folder` does), lets the engine plan the split (a
bad group is a ``ValueError`` before any weight is read), then reads each tensor this process
holds, or only its rank's slice of it, with safetensors' ``get_slice`` over the memory-mapped
files (:class:`~portable_llm.checkpoint.weights.SliceReader`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from portable_llm.backends import Backend, numpy_bfloat16
from portable_llm.checkpoint.build import LoadOptions
from portable_llm.checkpoint.config import config_path, read_config
from portable_llm.checkpoint.folder import read_generation_config
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
    """The model of this process's share of the checkpoint folder ``path``, and what it read."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"load: {str(path)!r} is not a folder")
    config_path(folder)
    if read_quantization(folder) is not None:
        raise ValueError(
            "load: tensor_parallel/pipeline_parallel of an mlx-lm quantized folder is not "
            "supported yet; load it whole, or a float checkpoint"
        )
    with SafetensorsFiles(folder) as st:
        cfg = read_config(folder, layers=st.layers, experts=st.experts)
        engine.plans(cfg)  # a bad group fails here, before the weights are read
        bk, target, dev = options.placement(stored_dtype(st, "model.embed_tokens.weight"))
        reader = SliceReader(st, cfg)
        host = _host_dtype(bk, target)
        held = 0

        def read(name: str, index: tuple[slice, ...]) -> np.ndarray:
            nonlocal held
            out = reader.read(name, index)
            out = out if out.dtype == host else out.astype(host)
            held += out.nbytes
            return out

        model = build_partitioned(
            engine, cfg, reader.shapes, read, bk, target, dev,
            tokenizer=read_tokenizer(folder),
            generation_config=read_generation_config(folder),
        )  # fmt: skip
        itemsize = np.dtype(host).itemsize
        total = sum(int(np.prod(s)) for s in reader.shapes.values()) * itemsize
        files = sum(f.stat().st_size for f in set(st.files.values()))
        return model, LoadReport(held, reader.touched, total, files)


def _host_dtype(bk: Backend, target: Any) -> Any:
    name = bk.dtype_name(target)
    return numpy_bfloat16() if name == "bfloat16" else np.dtype(name)
