"""Constrained decoding: a token mask per request, from a grammar engine chosen by name.

A :class:`Grammar` says what the output must be: JSON valid under a schema, between a literal
prefix and suffix (a tool call's ``<tool_call>\\n ... \\n</tool_call>``). A *grammar engine*
compiles it against the model's tokenizer into a :class:`Matcher`, which gives, before each token,
the ids allowed next (a mask over the vocabulary) and then accepts the token drawn.
:func:`constrained_logits` wraps matchers as a
:data:`~portable_llm.generation.sampler.LogitsProcessor`: the logits of ids not allowed become
``-inf`` before the sampler runs, so any sampler (greedy, top-p, seeded) draws inside the grammar.
Once the grammar is complete only the stop ids remain allowed, so the request ends there.

Engines are registered by name (:func:`register_grammar_engine`), as vLLM's structured-output
backends: ``llguidance`` (the default; in the ``serve`` extra) and ``xgrammar``
(used where installed and asked for by name). JSON is written compactly (``", "`` and ``": "``
separators, no other whitespace): a model cannot stall in whitespace, and the output is what
``json.dumps`` writes.

The cost of the mask per token is measured in ``benchmarks/grammar_mask.py`` (see
``benchmarks/README.md``).
"""

from portable_llm.generation.grammar import engines  # noqa: F401 (registers the engines)
from portable_llm.generation.grammar.mask import Constraint, constrained_logits, mask_logits
from portable_llm.generation.grammar.spec import (
    ENGINES,
    Grammar,
    GrammarEngine,
    Matcher,
    grammar_engine,
    grammar_of,
    register_grammar_engine,
    response_format_grammar,
)

__all__ = [
    "ENGINES",
    "Constraint",
    "Grammar",
    "GrammarEngine",
    "Matcher",
    "constrained_logits",
    "grammar_engine",
    "grammar_of",
    "mask_logits",
    "register_grammar_engine",
    "response_format_grammar",
]
