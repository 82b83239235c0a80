"""Hugging Face checkpoint folders (and mlx-lm quantized ones) read into a
:class:`~portable_llm.checkpoint.build.CheckpointContents`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from portable_llm.checkpoint.build import CheckpointContents, LoadOptions
from portable_llm.checkpoint.config import read_config, read_model_type
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

__all__ = ["read_folder", "read_generation_config"]


def read_folder(path: str | Path, options: LoadOptions | None = None, /) -> CheckpointContents:
    """Read a checkpoint folder (see :func:`portable_llm.load`): its config, weights by HF
    name, tokenizer and generation config. ``options``: default ``LoadOptions()``."""
    options = LoadOptions() if options is None else options
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"load: {str(path)!r} is not a folder")
    read_model_type(folder)  # no config.json, or another family: said before anything else
    quant = read_quantization(folder)  # mlx-lm's quantized folders (None: floats)
    with SafetensorsFiles(folder) as st:  # headers only: names, shapes, dtypes
        cfg = read_config(folder, layers=st.layers, experts=st.experts)
        tokenizer = read_tokenizer(folder)
        generation_config = read_generation_config(folder)
        bk, target, dev = options.placement(stored_dtype(st, "model.embed_tokens.weight"))
        if quant is None:
            weights = read_weights(st, cfg, bk, target, dev)
        else:
            weights = read_quantized_weights(
                st, cfg, bk, target, dev, quant, dequantize=options.dequantize
            )
    return CheckpointContents(cfg, weights, bk, tokenizer, generation_config)


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
