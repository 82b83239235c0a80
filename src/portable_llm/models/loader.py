""":func:`load`: a Hugging Face checkpoint folder as a :class:`~portable_llm.models.Model`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from portable_llm.backends import get_backend
from portable_llm.backends._base import FLOAT_DTYPES
from portable_llm.models.config import read_config
from portable_llm.models.model import Model
from portable_llm.models.tokenizer import read_tokenizer
from portable_llm.models.weights import read_weights

__all__ = ["load", "read_generation_config"]

_SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def load(
    path: str | Path, /, *, backend: str = "numpy", dtype: Any = None, device: Any = None
) -> Model:
    """Load a checkpoint folder (``config.json``, ``model.safetensors``, ``tokenizer.json``).

    Parameters
    ----------
    path : str or Path
        A local folder as ``save_pretrained`` writes it (or a Hub snapshot): ``config.json``,
        ``model.safetensors`` or ``model.safetensors.index.json`` with its shards; optionally
        ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``.
    backend : str
        The array library to run on (``"numpy"``, ``"torch"``, ``"mlx"``, ``"jax"``,
        ``"array_api_strict"``).
    dtype : str or dtype, optional
        The float dtype of the weights and activations; default: the checkpoint's own (that of
        ``model.embed_tokens.weight``). Tensors stored in another dtype are cast.
    device : str or device, optional
        Where the weights go: ``"cpu"``, ``"gpu"``, ``"cuda:0"``, ``"mps"``, ``"device1"``
        (array-api-strict) or the library's own device object; default: the backend's default
        device. Each tensor is read on the host and moved there at once; the model's inputs
        follow its weights.

    Returns
    -------
    Model

    Raises
    ------
    FileNotFoundError
        No ``config.json``, or no weights file.
    ValueError
        An unsupported ``model_type`` or rope type (the message lists the supported ones), a
        dtype the backend lacks (on ``device``), or a device it does not have.
    portable_llm.models.CheckpointError
        Tensors missing, unexpected or of the wrong shape (all of them listed).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"load: {str(path)!r} is not a folder")
    cfg = read_config(folder)
    bk = get_backend(backend)
    try:
        dev = None if device is None else bk.device(device)
    except ValueError as exc:
        raise ValueError(f"load: {exc}") from None
    name = dtype if dtype is not None else _stored_dtype(folder)
    try:
        target = bk.dtype(name, dev)
    except ValueError as exc:
        raise ValueError(f"load: {exc}; pass dtype= to load the checkpoint in another") from None
    if bk.dtype_name(target) not in FLOAT_DTYPES:
        raise ValueError(f"load: dtype must be a float dtype ({', '.join(FLOAT_DTYPES)})")
    weights = read_weights(folder, cfg, bk, target, dev)
    return Model(
        cfg,
        weights,
        bk,
        tokenizer=read_tokenizer(folder),
        generation_config=read_generation_config(folder),
    )


def read_generation_config(path: str | Path) -> dict[str, Any]:
    """``generation_config.json`` of a folder as a dict (empty when there is none)."""
    file = Path(path) / "generation_config.json"
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


def _stored_dtype(folder: Path) -> str:
    """The dtype ``model.embed_tokens.weight`` is stored in (read from the header only)."""
    from safetensors import safe_open

    name = "model.embed_tokens.weight"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        file = folder / json.loads(index.read_text(encoding="utf-8"))["weight_map"].get(
            name, "model.safetensors"
        )
    else:
        file = folder / "model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(
            f"load: no model.safetensors or model.safetensors.index.json in {str(folder)!r}"
        )
    with safe_open(file, framework="numpy") as f:
        if name not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
            return "float32"  # the weight check reports the missing tensor
        kind = f.get_slice(name).get_dtype()
    if kind not in _SAFETENSORS_DTYPES:
        raise ValueError(f"load: {name} is stored as {kind}, not a float dtype")
    return _SAFETENSORS_DTYPES[kind]
