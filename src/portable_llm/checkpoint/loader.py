""":func:`load`: a Hugging Face checkpoint folder as a :class:`~portable_llm.models.Model`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from portable_llm.backends import get_backend
from portable_llm.backends._base import FLOAT_DTYPES
from portable_llm.checkpoint.config import config_path, read_config
from portable_llm.checkpoint.files import CheckpointError, checkpoint_file, read_json
from portable_llm.checkpoint.quantized import (
    read_quantization,
    read_quantized_weights,
    stored_dtype,
)
from portable_llm.checkpoint.shards import SafetensorsFiles
from portable_llm.checkpoint.tokenizer import read_tokenizer
from portable_llm.checkpoint.weights import read_weights
from portable_llm.core.checks import check_int
from portable_llm.decoder.model import Model

__all__ = ["load", "read_generation_config"]


def load(
    path: str | Path,
    /,
    *,
    backend: str = "numpy",
    dtype: Any = None,
    device: Any = None,
    dequantize: bool = False,
) -> Model:
    """Load a checkpoint folder (``config.json``, ``model.safetensors``, ``tokenizer.json``).

    Parameters
    ----------
    path : str or Path
        A local folder as ``save_pretrained`` writes it (or a Hub snapshot): ``config.json``,
        ``model.safetensors`` or ``model.safetensors.index.json`` with its shards; optionally
        ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` and
        ``generation_config.json``. Every file must lie inside the folder (a Hub snapshot's
        symlinks into its repository's ``blobs/`` excepted).
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
    dequantize : bool
        A ``.gguf`` file (:mod:`portable_llm.checkpoint.gguf`): every weight as floats in
        ``dtype`` (transformers' reading) rather than kept quantized where the block type is
        exactly MLX's affine format.

    Returns
    -------
    Model

    Raises
    ------
    FileNotFoundError
        No ``config.json``, or no weights file (or a shard the index names).
    ValueError
        A dtype the backend lacks (on ``device``), or a device it does not have.
    portable_llm.models.CheckpointError
        (a ``ValueError``) Anything wrong with the folder's files, named in the message: a
        malformed JSON file, safetensors file or ``tokenizer.json``; a path out of the folder;
        a config value of the wrong type or range, an unsupported ``model_type`` or rope type
        (the message lists the supported ones), more layers or experts than the weights hold;
        tensors missing, unexpected, of the wrong shape or not float (all of them listed).
    """
    folder = Path(path)
    if folder.suffix == ".gguf" and not folder.is_dir():
        from portable_llm.checkpoint.gguf import load_gguf

        return load_gguf(folder, backend=backend, dtype=dtype, device=device, dequantize=dequantize)
    if not folder.is_dir():
        raise FileNotFoundError(f"load: {str(path)!r} is not a folder")
    config_path(folder)  # a folder without config.json says so before anything else
    quant = read_quantization(folder)  # mlx-lm's quantized folders (None: floats)
    with SafetensorsFiles(folder) as st:  # headers only: names, shapes, dtypes
        cfg = read_config(folder, layers=st.layers, experts=st.experts)
        tokenizer = read_tokenizer(folder)
        generation_config = read_generation_config(folder)
        bk = get_backend(backend)
        try:
            dev = None if device is None else bk.device(device)
        except ValueError as exc:
            raise ValueError(f"load: {exc}") from None
        name = dtype if dtype is not None else stored_dtype(st, "model.embed_tokens.weight")
        try:
            target = bk.dtype(name or "float32", dev)  # no embeddings: the check reports them
        except ValueError as exc:
            raise ValueError(
                f"load: {exc}; pass dtype= to load the checkpoint in a dtype the backend has "
                f'(e.g. dtype="float32")'
            ) from None
        if bk.dtype_name(target) not in FLOAT_DTYPES:
            raise ValueError(f"load: dtype must be a float dtype ({', '.join(FLOAT_DTYPES)})")
        if quant is None:
            weights = read_weights(st, cfg, bk, target, dev)
        else:
            weights = read_quantized_weights(st, cfg, bk, target, dev, quant)
    return Model(cfg, weights, bk, tokenizer=tokenizer, generation_config=generation_config)


def read_generation_config(path: str | Path) -> dict[str, Any]:
    """``generation_config.json`` of a folder as a dict (empty when there is none).

    Raises :class:`~portable_llm.models.CheckpointError` naming the file when it is not a JSON
    object, or its ``eos_token_id`` (the default stop tokens) is not an int >= 0 or a list of
    them.
    """
    file = checkpoint_file(path, "generation_config.json")
    if not file.is_file():
        return {}
    config: dict[str, Any] = read_json(file)
    eos = config.get("eos_token_id")
    for token in eos if isinstance(eos, list) else [] if eos is None else [eos]:
        try:
            check_int("eos_token_id", "each id", token, low=0)
        except (TypeError, ValueError):
            raise CheckpointError(
                f"load: {str(file)!r}: eos_token_id must be an int >= 0 or a list of them, "
                f"got {eos!r}"
            ) from None
    return config
