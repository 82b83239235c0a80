"""The safetensors files of a checkpoint folder: the shard index, the files, their headers.

:class:`SafetensorsFiles` finds the files (``model.safetensors``, or the shards that
``model.safetensors.index.json`` names, each checked to lie inside the folder), opens them and
reads their headers only: which tensors they hold, with shapes and dtypes. A file that is not
valid safetensors (truncated, garbage, a header whose offsets lie) is a
:class:`~portable_llm.models.CheckpointError` naming it. :func:`portable_llm.load` checks the
config against the headers (layer and expert counts, then every tensor) before it reads data.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from portable_llm.backends import numpy_bfloat16
from portable_llm.checkpoint.files import CheckpointError, checkpoint_file, read_json

__all__ = ["INDEX", "SAFETENSORS_FLOATS", "SINGLE", "SafetensorsFiles"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: safetensors dtype codes of the float dtypes a checkpoint may store.
SAFETENSORS_FLOATS = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
# A decoder layer's tensors: ``model.layers.{i}.`` (Llama-like, Phi) or ``[transformer.]h.{i}.``
# (GPT-2 with or without GPT2LMHeadModel's prefix; mlx-lm's GPT-2: ``model.h.{i}.``).
_LAYER = re.compile(r"^(?:model\.layers|(?:transformer\.|model\.)?h)\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
#: Stacked experts (leading dimension X): HF v5's, and mlx-lm's (its quantized folders).
_STACKED = (".experts.gate_up_proj", ".experts.down_proj", ".switch_mlp.down_proj.weight")


class SafetensorsFiles:
    """The safetensors files of a checkpoint folder, opened, their headers read (no data).

    ``files`` maps each tensor name to the file holding it (the shard index's word for a
    sharded checkpoint), ``shapes``/``dtypes`` give the headers' shape and dtype code
    (``"BF16"``) of the tensors the files hold, ``misplaced`` the tensors the index maps to a
    shard that lacks them (name -> shard). Use it as a context manager (it holds the files
    open), or through :func:`read_weights`.

    Raises
    ------
    FileNotFoundError
        No ``model.safetensors`` nor ``model.safetensors.index.json``, or a shard the index
        names is not in the folder.
    CheckpointError
        An index that is not JSON or has no ``weight_map``, a path that leads out of the
        folder, or a file that is not valid safetensors (truncated, garbage, a header whose
        offsets lie): the message names the file.
    """

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        self.index, index_map, paths = _layout(self.folder)
        self.handles: dict[Path, Any] = {}
        header: dict[Path, dict[str, tuple[tuple[int, ...], str]]] = {}
        self._stack = ExitStack()
        try:
            for file in paths:
                try:
                    h = self._stack.enter_context(safe_open(file, framework="numpy"))
                    slices = {name: h.get_slice(name) for name in h.keys()}  # noqa: SIM118
                    header[file] = {
                        name: (tuple(p.get_shape()), str(p.get_dtype()))
                        for name, p in slices.items()
                    }
                except Exception as exc:  # safetensors' SafetensorError, an OSError, ...
                    raise CheckpointError(
                        f"load: {str(file)!r} is not a valid safetensors file ({exc})"
                    ) from None
                self.handles[file] = h
        except BaseException:
            self._stack.close()
            raise
        #: Tensor name -> the file holding it (as the index says, for a sharded checkpoint).
        self.files: dict[str, Path] = (
            index_map if index_map is not None else dict.fromkeys(header[paths[0]], paths[0])
        )
        #: The tensors the index maps to a shard that lacks them (name -> shard file name).
        self.misplaced = {n: f.name for n, f in self.files.items() if n not in header[f]}
        held = [(n, header[f][n]) for n, f in self.files.items() if n not in self.misplaced]
        self.shapes: dict[str, tuple[int, ...]] = {n: shape for n, (shape, _) in held}
        self.dtypes: dict[str, str] = {n: kind for n, (_, kind) in held}

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    @property
    def layers(self) -> int:
        """How many decoder layers the files hold tensors of (``model.layers.{i}.``, GPT-2's
        ``transformer.h.{i}.``, ``h.{i}.`` and mlx-lm's ``model.h.{i}.``)."""
        found = [int(m[1]) for name in self.files if (m := _LAYER.match(name))]
        return max(found) + 1 if found else 0

    @property
    def experts(self) -> int:
        """How many experts the files hold: per-expert tensors' indices, or the leading
        dimension of stacked ones (0 for a dense model)."""
        found = [int(m[1]) + 1 for name in self.files if (m := _EXPERT.search(name))]
        found += [
            self.shapes[name][0]
            for name in self.files
            if name.endswith(_STACKED) and len(self.shapes.get(name, ())) == 3
        ]
        return max(found, default=0)

    def stored_dtype(self, name: str) -> str | None:
        """The float dtype ``name`` is stored in (``None`` when the files lack it);
        :class:`CheckpointError` naming it and its file when it is not a float."""
        kind = self.dtypes.get(name)
        if kind is None:
            return None
        if kind not in SAFETENSORS_FLOATS:
            raise CheckpointError(
                f"load: {name} in {str(self.files[name])!r} is stored as {kind}, not a float "
                f"dtype ({', '.join(SAFETENSORS_FLOATS)})"
            )
        return SAFETENSORS_FLOATS[kind]

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """Tensor ``name`` as a NumPy array, or only its slice ``index`` (one ``slice`` per
        leading dimension; read alone from the memory-mapped file); :class:`CheckpointError`
        when it cannot be read."""
        file = self.files[name]
        if self.dtypes.get(name) == "BF16":
            numpy_bfloat16()  # safetensors reads BF16 into NumPy as ml_dtypes' (once imported)
        try:
            if index is not None and any(s != slice(None) for s in index):
                return self.handles[file].get_slice(name)[index]
            return self.handles[file].get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"load: cannot read {name} from {str(file)!r} ({exc})") from None


def _layout(folder: Path) -> tuple[Path | None, dict[str, Path] | None, list[Path]]:
    """``(index file, tensor name -> shard, files to open)``; the first two ``None`` for a
    single ``model.safetensors``. Every path is checked to lie inside ``folder``."""
    index = checkpoint_file(folder, INDEX)
    if not index.is_file():
        single = checkpoint_file(folder, SINGLE)
        if not single.is_file():
            raise FileNotFoundError(f"load: no {SINGLE} or {INDEX} in {str(folder)!r}")
        return None, None, [single]
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"load: {str(index)!r} has no weight_map (an object from tensor names to shard "
            f"file names); got {type(weight_map).__name__}"
        )
    shards = {
        f: checkpoint_file(folder, f, named_by=str(index)) for f in sorted(set(weight_map.values()))
    }
    absent = [f for f, path in shards.items() if not path.is_file()]
    if absent:
        raise FileNotFoundError(
            f"load: {index} names shard files that are not in the folder: {', '.join(absent)}"
        )
    return index, {name: shards[f] for name, f in weight_map.items()}, list(shards.values())
