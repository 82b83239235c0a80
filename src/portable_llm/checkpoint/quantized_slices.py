"""An mlx-lm quantized folder read by one rank of a partitioned model, kept quantized.

:class:`QuantizedSlices` reads each tensor a rank holds, or only its slice, from the
memory-mapped safetensors files (as :class:`~portable_llm.checkpoint.weights.SliceReader` does
for a float folder): a quantized module's codes, scales and biases are cut along whole groups
(:func:`~portable_llm.partition.plan.quantized_index`: output rows as they are, the input
dimension only at group boundaries), so each rank holds its share still quantized.
"""

from __future__ import annotations

import numpy as np

from portable_llm.checkpoint.mlx_layout import join_kv_b
from portable_llm.checkpoint.quantized import Quantization, check_quantized, host_values
from portable_llm.checkpoint.shards import SafetensorsFiles
from portable_llm.checkpoint.weights import read_span
from portable_llm.decoder.config import DecoderConfig
from portable_llm.partition.engine import QuantizedSlice
from portable_llm.partition.plan import quantized_index

__all__ = ["QuantizedSlices"]

#: The weights a tensor-parallel split cuts along their input dimension.
_INPUT_SPLIT = ("o_proj.weight", "down_proj.weight", "experts.down_proj")


class QuantizedSlices:
    """Any tensor of an mlx-lm quantized folder, or one slice of it, read alone.

    ``st``: the files, open; ``cfg`` and ``quant``: the config and the ``"quantization"`` they
    are checked against at once (:func:`~portable_llm.checkpoint.quantized.check_quantized`).
    ``shapes`` maps the model's names to their dequantized shapes; ``touched`` counts the
    bytes of the file spans read; ``group_size`` is the largest group of the weights a
    tensor-parallel split cuts along their input (``None`` when none is quantized).
    """

    def __init__(self, st: SafetensorsFiles, cfg: DecoderConfig, quant: Quantization) -> None:
        self.st = st
        self.entries = check_quantized(st, cfg, quant)  # name -> (stored, shape, format, rows)
        self.shapes = {name: e.shape for name, e in self.entries.items()}
        groups = [
            e.fmt[1] for name, e in self.entries.items()
            if e.fmt is not None and name.endswith(_INPUT_SPLIT)
        ]  # fmt: skip
        self.group_size = max(groups, default=None)
        self.touched = 0

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray | QuantizedSlice:
        """Tensor ``name`` (a key of :attr:`shapes`), or its slice ``index`` in the coordinates
        of its dequantized shape: a float array, or a quantized module's whole groups."""
        stored, shape, fmt, rows, axes, parts, offset = self.entries[name]
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if parts is not None:  # DeepSeek's kv_b_proj, joined from its halves (read whole)
            halves = (host_values(self._whole, e) for e in parts)
            return np.ascontiguousarray(join_kv_b(*halves)[index])
        if axes is not None:  # read whole, in the model's axis order
            whole = self._read(stored, (slice(None),) * len(shape))
            return np.ascontiguousarray(whole.transpose(axes)[index])
        if fmt is None:
            host = self._read(stored, _rows(index, shape, rows))
            return host - np.asarray(offset, dtype=host.dtype) if offset else host
        bits, group = fmt
        codes, groups = quantized_index(name, shape, index, bits, group)
        stem = stored.removesuffix(".weight")
        return QuantizedSlice(
            self._read(stored, _rows(codes, shape, rows)),
            self._read(stem + ".scales", _rows(groups, shape, rows)),
            self._read(stem + ".biases", _rows(groups, shape, rows)),
            bits,
            group,
        )

    def quantized(self, name: str) -> tuple[int, int] | None:
        """``(bits, group_size)`` of tensor ``name`` (``None``: read as floats)."""
        return self.entries[name].fmt

    def _whole(self, name: str) -> np.ndarray:
        return self._read(name, (slice(None),) * len(self.st.shapes[name]))

    def _read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        out, self.touched = read_span(self.st, name, index, self.touched)
        return out


def _rows(
    index: tuple[slice, ...], shape: tuple[int, ...], rows: tuple[int, int] | None
) -> tuple[slice, ...]:
    """``index`` (in a fused module's part, ``shape``) in the stored module's rows."""
    if rows is None:
        return index
    start, stop, step = index[0].indices(shape[0])
    return (slice(rows[0] + start, rows[0] + stop, step), *index[1:])
