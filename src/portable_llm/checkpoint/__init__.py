"""Checkpoints as a ``Model``: HF folders, shards, mlx-lm quantized folders and GGUF files."""

from portable_llm.checkpoint.config import read_config
from portable_llm.checkpoint.files import CheckpointError
from portable_llm.checkpoint.loader import load

__all__ = ["CheckpointError", "load", "read_config"]
