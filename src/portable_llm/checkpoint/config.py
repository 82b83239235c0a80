"""The `config.json` of a checkpoint folder, read into a `DecoderConfig`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from portable_llm.checkpoint.files import CheckpointError, checkpoint_file, read_json
from portable_llm.decoder.config import DecoderConfig, check_model_type, hf_spelling

__all__ = ["check_held", "config_path", "read_config", "read_model_type"]


def config_path(path: str | Path) -> Path:
    """``config.json`` of a checkpoint folder; ``FileNotFoundError`` when there is none."""
    file = checkpoint_file(path, "config.json")
    if not file.is_file():
        raise FileNotFoundError(
            f"load: no config.json in {str(path)!r} (a Hugging Face checkpoint folder holds "
            "config.json next to model.safetensors)"
        )
    return file


def read_model_type(path: str | Path) -> str:
    """``model_type`` of a folder's ``config.json``, when ``pl.load`` runs it: the first check of
    every folder reader, before the weights, a quantization entry or any other field is looked
    at, so a folder of another family (a BERT) is answered with its model type and the
    supported list.

    Raises ``FileNotFoundError`` (no ``config.json``), or :class:`CheckpointError` naming the
    file: not a JSON object, or a ``model_type`` missing or not supported (listing those that
    are).
    """
    file = config_path(path)
    d = read_json(file)
    _check_type(file, d)
    return str(d["model_type"])


def _check_type(file: Path, d: dict[str, Any]) -> None:
    try:
        check_model_type(d)
    except ValueError as exc:
        raise CheckpointError(
            f"load: {str(file)!r}: {str(exc).removeprefix('config.json: ')}"
        ) from None


def check_held(file: str | Path, key: str, value: int, held: int, what: str) -> None:
    """Refuse a count (``num_hidden_layers``, a GGUF ``block_count``) larger than what the
    weights hold, before anything is built from it: the one rule of every reader, so a config
    asking for ``10**7`` layers fails at once instead of listing ten million missing tensors."""
    if value > held:
        raise CheckpointError(
            f"load: {str(file)!r}: {key}={value} but the weights hold {held} {what}"
        )


def read_config(
    path: str | Path, /, *, layers: int | None = None, experts: int | None = None
) -> DecoderConfig:
    """Read ``config.json`` of a checkpoint folder.

    ``layers``/``experts``: how many decoder layers and experts the weights hold
    (:class:`~portable_llm.checkpoint.shards.SafetensorsFiles`); a config that asks for more is
    refused before anything is built from it (``num_hidden_layers: 10**7`` fails at once).

    Raises
    ------
    FileNotFoundError
        No ``config.json``.
    CheckpointError
        ``config.json`` is not a JSON object, or :meth:`DecoderConfig.from_dict` refuses it, or
        it asks for more layers or experts than the weights hold: the message names the file.
    """
    file = config_path(path)
    d = read_json(file)
    _check_type(file, d)  # first: a folder of another family is answered with its model type
    d = hf_spelling(d)  # GPT-2's n_layer is checked as num_hidden_layers
    counts = {"num_hidden_layers": layers}
    if d.get("model_type") in ("mixtral", "qwen2_moe", "qwen3_moe"):
        counts["num_local_experts" if d.get("model_type") == "mixtral" else "num_experts"] = experts
    for key, held in counts.items():
        value = d.get(key)
        if held is None or isinstance(value, bool) or not isinstance(value, int):
            continue  # from_dict reports a value of the wrong type
        check_held(file, key, value, held, "layers" if key == "num_hidden_layers" else "experts")
    try:
        return DecoderConfig.from_dict(d)
    except ValueError as exc:
        message = str(exc).removeprefix("config.json: ")
        raise CheckpointError(f"load: {str(file)!r}: {message}") from None
