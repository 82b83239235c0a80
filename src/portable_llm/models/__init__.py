"""Hugging Face checkpoints on any backend: config, weights, the decoder, tokenizer, generation."""

from portable_llm.models.batch import BatchGenerator, Request, batch_generate
from portable_llm.models.config import SUPPORTED_MODEL_TYPES, DecoderConfig, read_config
from portable_llm.models.files import CheckpointError
from portable_llm.models.generate import Generation, GenerationStats, generate
from portable_llm.models.loader import load
from portable_llm.models.model import Model
from portable_llm.models.sampler import make_logits_processors, make_sampler
from portable_llm.models.speculative import SpeculativeStats, speculative_generate
from portable_llm.models.steps import generate_step
from portable_llm.models.tokenizer import Tokenizer

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "BatchGenerator",
    "CheckpointError",
    "DecoderConfig",
    "Generation",
    "GenerationStats",
    "Model",
    "Request",
    "SpeculativeStats",
    "Tokenizer",
    "batch_generate",
    "generate",
    "generate_step",
    "load",
    "make_logits_processors",
    "make_sampler",
    "read_config",
    "speculative_generate",
]
