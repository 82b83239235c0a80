"""Checkpoints as a ``Model``: HF folders, shards, mlx-lm quantized folders and GGUF files."""

from portable_llm.checkpoint.build import CheckpointContents, LoadOptions, build_model
from portable_llm.checkpoint.config import read_config
from portable_llm.checkpoint.files import CheckpointError
from portable_llm.checkpoint.loader import load, read_checkpoint

__all__ = [
    # reading
    "CheckpointContents",
    "LoadOptions",
    "load",
    "read_checkpoint",
    "read_config",
    # building
    "build_model",
    # errors
    "CheckpointError",
]
