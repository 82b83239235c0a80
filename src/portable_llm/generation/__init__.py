"""Generation over any model: the decode loop, samplers, batching and speculative decoding."""

from portable_llm.generation.batch import BatchGenerator, Request, batch_generate
from portable_llm.generation.generate import Generation, GenerationStats, generate
from portable_llm.generation.perplexity import PerplexityResult, perplexity
from portable_llm.generation.prompt import prompt_ids, sampling_options, stop_ids
from portable_llm.generation.protocol import (
    BatchDecodingModel,
    DecodeStepModel,
    LanguageModel,
    MaterializingModel,
    PagedLanguageModel,
    RecomputingModel,
    ReleasingModel,
    RewindingModel,
    SizedVocabularyModel,
)
from portable_llm.generation.sampler import make_logits_processors, make_sampler
from portable_llm.generation.speculative import SpeculativeStats, speculative_generate
from portable_llm.generation.steps import generate_step

__all__ = [
    # the model protocol (docs/bring-your-own-model.md)
    "BatchDecodingModel",
    "DecodeStepModel",
    "LanguageModel",
    "MaterializingModel",
    "PagedLanguageModel",
    "RecomputingModel",
    "ReleasingModel",
    "RewindingModel",
    "SizedVocabularyModel",
    # the decode loop and its fronts
    "BatchGenerator",
    "Generation",
    "GenerationStats",
    "Request",
    "SpeculativeStats",
    "batch_generate",
    "generate",
    "generate_step",
    "speculative_generate",
    # judging a model on text (perplexity, KL divergence from a base)
    "PerplexityResult",
    "perplexity",
    # samplers and the checks every front shares
    "make_logits_processors",
    "make_sampler",
    "prompt_ids",
    "sampling_options",
    "stop_ids",
]
