"""The decoder: config, per-layer weights, `Model`, its prepared, compiled and paged forwards."""

from portable_llm.decoder.config import SUPPORTED_MODEL_TYPES, DecoderConfig
from portable_llm.decoder.model import Model

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderConfig", "Model"]
