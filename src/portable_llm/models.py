"""``portable_llm.models``: the model-level names in one place (a re-export module).

The code lives in :mod:`portable_llm.decoder` (the model), :mod:`portable_llm.checkpoint`
(reading it), :mod:`portable_llm.text` (its tokenizer) and :mod:`portable_llm.generation`
(driving it); ``pl.models.X`` keeps resolving for every name below.
"""

from portable_llm.checkpoint import CheckpointError, load, read_config
from portable_llm.decoder import SUPPORTED_MODEL_TYPES, DecoderConfig, Model
from portable_llm.generation import (
    BatchGenerator,
    Generation,
    GenerationStats,
    Request,
    SpeculativeStats,
    batch_generate,
    generate,
    generate_step,
    make_logits_processors,
    make_sampler,
    speculative_generate,
)
from portable_llm.text import Tokenizer

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
