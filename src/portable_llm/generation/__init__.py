"""Generation over any model: the decode loop, samplers, batching and speculative decoding."""

from portable_llm.generation.batch import BatchGenerator, Request, batch_generate
from portable_llm.generation.generate import Generation, GenerationStats, generate
from portable_llm.generation.sampler import make_logits_processors, make_sampler
from portable_llm.generation.speculative import SpeculativeStats, speculative_generate
from portable_llm.generation.steps import generate_step

__all__ = [
    "BatchGenerator",
    "Generation",
    "GenerationStats",
    "Request",
    "SpeculativeStats",
    "batch_generate",
    "generate",
    "generate_step",
    "make_logits_processors",
    "make_sampler",
    "speculative_generate",
]
