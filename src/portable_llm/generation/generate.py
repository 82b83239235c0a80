""":func:`generate`: stream the continuation of a prompt (or of a batch of prompts).

The front of the decode loop :func:`~portable_llm.generate_step` (which yields one
``(token, logprobs)`` per step): it encodes text, makes the sampler
(:func:`~portable_llm.make_sampler`) and the logits processors, streams text with the
tokenizer, and keeps statistics. Generation stops at ``max_new_tokens`` or at a stop token (by
default the ``eos_token_id`` of ``generation_config.json``, else of ``config.json``), which is
not yielded.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from portable_llm.attn.padding import left_pad
from portable_llm.core.checks import check_int, check_optional_int, check_real
from portable_llm.generation.grammar import constrained_logits, grammar_engine, grammar_of
from portable_llm.generation.penalties import Penalties
from portable_llm.generation.prompt import is_text_batch, prompt_ids, sampling_options, stop_ids
from portable_llm.generation.protocol import (
    LanguageModel,
    check_cache_list,
    check_model,
    vocab_size,
)
from portable_llm.generation.sampler import (
    LogitsProcessor,
    Sampler,
    make_logits_processors,
    make_sampler,
)
from portable_llm.generation.steps import PREFILL_STEP_SIZE, check_prefill_step_size, decode
from portable_llm.generation.tokenizer import text_tokenizer

__all__ = ["Generation", "GenerationStats", "generate", "stop_tokens"]

OP = "generate"


@dataclass
class GenerationStats:
    """Token counts and wall-clock times of one generation (filled in as it runs)."""

    prompt_tokens: int = 0
    #: Time of the prefill, up to the first new token on the host.
    prefill_seconds: float = 0.0
    #: Tokens yielded (a stop token is not).
    generated_tokens: int = 0
    #: Forward passes after the prefill (one per token decoded, a final stop token included).
    decode_steps: int = 0
    decode_seconds: float = 0.0
    #: The stop token that ended the generation (``None``: it ran to ``max_new_tokens``).
    stop_token: int | None = None
    #: Why it ended: ``"stop"`` (a stop token) or ``"length"`` (``max_new_tokens``); ``None``
    #: while it runs.
    finish_reason: str | None = None

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Decode steps per second (the first new token comes with the prefill)."""
        return self.decode_steps / self.decode_seconds if self.decode_seconds else 0.0


class Generation:
    """The iterator :func:`generate` returns; ``stats`` holds the counts and times so far."""

    def __init__(self, pieces: Iterator[Any], stats: GenerationStats) -> None:
        self._pieces = pieces
        self.stats = stats

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> Any:
        return next(self._pieces)


def stop_tokens(model: LanguageModel) -> tuple[int, ...]:
    """The default stop ids: ``model.eos_token_ids`` (for a :class:`~portable_llm.Model`,
    ``generation_config.json``'s ``eos_token_id``, else config.json's)."""
    return tuple(model.eos_token_ids)


# Over 80 lines for its docstring (every argument of OpenAI's and mlx-lm's sampling); the code
# checks every argument before the model runs (~35 lines), then hands over to _Run.
def generate(
    model: LanguageModel,
    prompt: str | Sequence[int] | Sequence[str] | Any,
    /,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: Iterable[int] | None = None,
    repetition_penalty: float | None = None,
    repetition_context_size: int | None = 20,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
    prompt_cache: list[Any] | None = None,
    prefill_step_size: int | None = PREFILL_STEP_SIZE,
    response_format: Any = None,
) -> Generation:
    """Stream the model's continuation of ``prompt``.

    Parameters
    ----------
    model : LanguageModel
        A :class:`~portable_llm.Model`, or any object that follows
        :class:`~portable_llm.generation.LanguageModel` (``docs/bring-your-own-model.md``).
    prompt : str, a sequence or 1-D array of token ids, or a list of str
        A string is encoded with the model's tokenizer (without adding a BOS when the text
        already starts with the tokenizer's ``bos_token``, as a rendered chat template does),
        and the iterator yields text pieces (whose concatenation is the decoded
        continuation). Token ids (of any backend) make the iterator yield token ids (``int``).
        A list of strings is one left-padded batch: the iterator yields lists of text pieces,
        one per prompt (``""`` where a prompt has no new text, or has stopped); a prompt's
        pieces together are its decoded continuation.
    max_new_tokens : int, >= 0
    temperature, top_k, top_p, min_p
        As for :func:`portable_llm.sample`; ``temperature=0`` (the default) is greedy.
        ``top_k`` in ``[1, vocab_size]``.
    seed : int, >= 0, optional
        Makes sampling reproducible on a backend (:func:`~portable_llm.make_sampler`): the draw
        of step ``t`` uses a seed derived from ``seed`` and ``t``. ``None``: fresh entropy.
    stop : iterable of int, optional
        Stop token ids; default :func:`stop_tokens` (the checkpoint's EOS ids). ``()``: none.
    repetition_penalty, repetition_context_size
        As for :func:`~portable_llm.make_logits_processors` (``repetition_context_size=None``:
        the whole prompt and output, as transformers and vLLM).
    frequency_penalty, presence_penalty : float in ``[-2, 2]``
        Subtracted from the logit of each generated token, once per time it was generated /
        once if it was (OpenAI's definition; the prompt does not count).
    logit_bias : mapping of token id to float in ``[-100, 100]``, optional
        Added to those logits before sampling (``-100`` bans a token, ``100`` forces it).
    min_tokens : int in ``[0, max_new_tokens]``
        The stop tokens get ``-inf`` until this many tokens were generated.
    ignore_eos : bool
        With ``stop=None``: the EOS ids do not stop the generation (vLLM's ``ignore_eos``).
    prompt_cache : list of caches, optional
        ``model.make_cache()``, empty or holding an earlier conversation: the prompt follows
        the tokens it holds, and once the iterator is exhausted it holds the prompt and every
        new token too (a final stop token included), ready for the next turn. Not with a batch.
        When the first step fails, the caches are trimmed back to what they held (caches with
        ``offset`` and ``trim(n)``, as :class:`~portable_llm.KVCache`).
    prefill_step_size : int, >= 1, optional
        The prompt runs through the model in chunks of at most this many tokens (default
        2048), which bounds the prefill's memory; ``None``: one chunk. As for
        :func:`~portable_llm.generate_step`.
    response_format : dict or Grammar, optional
        Constrained decoding (``docs/structured-outputs.md``): OpenAI's ``{"type":
        "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": {...}}}``, or a
        :class:`~portable_llm.generation.grammar.Grammar`. Each step's logits outside the
        grammar are ``-inf`` before the sampler, so the text is valid JSON under the schema
        once it stops (at the grammar's end only a stop token is allowed); ``max_new_tokens``
        may still cut it short (``finish_reason == "length"``). Needs the tokenizer, a stop
        token and a grammar engine (llguidance, in the ``serve`` extra).

    Every argument is checked here, when ``generate`` is called, before the model runs
    (integers may be Python or NumPy integers, never ``bool``): a bad one is a ``TypeError``
    or ``ValueError`` naming it, not an error after the prefill.

    Returns
    -------
    Generation
        An iterator; its ``stats`` (:class:`GenerationStats`) holds the prompt length, the
        prefill time (up to the first new token), the tokens generated, the decode time and
        the ``finish_reason`` (``"stop"``: a stop token, for a batch every prompt's; ``"length"``:
        ``max_new_tokens``).
    """
    model = check_model(OP, model)
    batch = is_text_batch(prompt)
    text = batch or isinstance(prompt, str)
    rows = _prompt_rows(model, prompt, batch)
    max_new_tokens = check_int(OP, "max_new_tokens", max_new_tokens, low=0)
    V = vocab_size(model)  # None: the first logits tell
    options = sampling_options(temperature, top_k, top_p, min_p, vocab_size=V)
    seed = check_optional_int(OP, "seed", seed, low=0)
    stops = stop_ids(model, stop, op=OP, ignore_eos=ignore_eos)
    p = Penalties.check(
        OP, vocab_size=V, max_new_tokens=max_new_tokens,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        logit_bias=logit_bias, min_tokens=min_tokens,
    )  # fmt: skip
    processors = make_logits_processors(
        repetition_penalty=_penalty(repetition_penalty),
        repetition_context_size=check_optional_int(
            OP, "repetition_context_size", repetition_context_size, low=1
        ),
        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        logit_bias=dict(p.logit_bias), min_tokens=p.min_tokens, stop=stops, vocab_size=V,
    )  # fmt: skip
    grammar = grammar_of(response_format)
    if grammar is not None:
        processors.append(_grammar_processor(model, grammar, V, stops, len(rows)))
    if prompt_cache is not None and batch:
        raise ValueError("generate: prompt_cache is for one prompt, not a batch")
    if prompt_cache is not None:
        prompt_cache = check_cache_list(OP, "prompt_cache", prompt_cache, model)
    chunk = check_prefill_step_size(OP, prefill_step_size)
    stats = GenerationStats(prompt_tokens=sum(len(r) for r in rows))
    if max_new_tokens == 0 and prompt_cache is None:  # nothing to run, no caches to make
        stats.finish_reason = "length"
        return Generation(iter(()), stats)
    run = _Run(model, make_sampler(**options, seed=seed), processors, stops, stats, chunk)
    tokenizer = text_tokenizer(model.tokenizer)  # not None for text: prompt_ids refused it
    if batch:
        return Generation(_batch_pieces(run, rows, max_new_tokens, tokenizer), stats)
    tokens = run.tokens(rows[0], max_new_tokens, prompt_cache)
    if text:
        return Generation(tokenizer.stream(tokens), stats)
    return Generation(tokens, stats)


def _prompt_rows(model: LanguageModel, prompt: Any, batch: bool) -> list[Any]:
    """The token ids of each prompt: one row, or one per prompt of a text batch."""
    if batch:
        return [prompt_ids(model, p, op=OP, name=f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [prompt_ids(model, prompt, op=OP)]


def _grammar_processor(
    model: LanguageModel, grammar: Any, V: int | None, stops: frozenset[int], rows: int
) -> LogitsProcessor:
    """The logits processor of ``response_format``: one grammar matcher per row."""
    if not stops:
        raise ValueError("generate: response_format needs a stop token (stop=() has none)")
    if V is None:
        raise ValueError("generate: response_format needs the model's vocab_size")
    engine = grammar_engine(model.tokenizer, vocab_size=V, stop_ids=stops)
    return constrained_logits([engine.matcher(grammar) for _ in range(rows)])


def _penalty(value: Any) -> float | None:
    if value is None:
        return None
    return check_real(OP, "repetition_penalty", value, low=0, low_open=True)


@dataclass
class _Run:
    """What one generation needs beside its prompt: model, sampler, processors, stops, stats."""

    model: LanguageModel
    sampler: Sampler
    processors: list[LogitsProcessor]
    stops: frozenset[int]
    stats: GenerationStats
    prefill_step_size: int | None = PREFILL_STEP_SIZE

    def timed(self, steps: Iterator[tuple[Any, Any]], step: int) -> Any:
        start = time.perf_counter()
        token, _ = next(steps)
        elapsed = time.perf_counter() - start
        if step == 0:
            self.stats.prefill_seconds = elapsed
        else:
            self.stats.decode_steps += 1
            self.stats.decode_seconds += elapsed
        return token

    def tokens(
        self, ids: list[int], max_new_tokens: int, prompt_cache: list[Any] | None
    ) -> Iterator[int]:
        """The new token ids of one prompt, one at a time; fills ``stats`` as it goes."""
        stats, model = self.stats, self.model
        steps = decode(
            model, ids, sampler=self.sampler, logits_processors=self.processors,
            cache=prompt_cache, left_padding=None, logprobs=False,
            prefill_step_size=self.prefill_step_size, max_tokens=max_new_tokens,
        )  # fmt: skip
        stops = self.stops
        held = None if prompt_cache is None else [c.offset for c in prompt_cache]
        try:
            for step in range(max_new_tokens):
                try:
                    last = self.timed(steps, step)
                except BaseException:
                    if step == 0 and held is not None:  # the prompt_cache as it was given
                        _rewind(prompt_cache or [], held)
                    raise
                if last in stops:
                    stats.stop_token = last
                    break
                stats.generated_tokens += 1
                yield last
            stats.finish_reason = "length" if stats.stop_token is None else "stop"
        finally:
            steps.close()  # caches made here go back to the model (ReleasingModel)
        if prompt_cache is not None:  # the cache then holds every token of the conversation
            steps.feed_last()


def _batch_pieces(
    run: _Run, rows: list[list[int]], max_new_tokens: int, tokenizer: Any
) -> Iterator[list[str]]:
    """One list of text pieces per step, one piece per prompt (``""``: none, or stopped)."""
    ids, left_padding = left_pad(rows)
    steps = decode(
        run.model, ids, sampler=run.sampler, logits_processors=run.processors, cache=None,
        left_padding=left_padding, logprobs=False, prefill_step_size=run.prefill_step_size,
        max_tokens=max_new_tokens,
    )  # fmt: skip
    try:
        yield from _batch_steps(run, steps, rows, max_new_tokens, tokenizer)
    finally:
        steps.close()  # the caches go back to the model (ReleasingModel)


def _batch_steps(
    run: _Run, steps: Any, rows: list[list[int]], max_new_tokens: int, tokenizer: Any
) -> Iterator[list[str]]:
    texts = [tokenizer.stream_decoder() for _ in rows]
    done = [False] * len(rows)
    for step in range(max_new_tokens):
        chosen = run.timed(steps, step)
        pieces = []
        for b, token in enumerate(chosen.tolist()):
            if done[b]:
                pieces.append("")
            elif token in run.stops:  # the row ends: the text its stream held back
                done[b] = True
                pieces.append(texts[b].finish())
            else:
                run.stats.generated_tokens += 1
                pieces.append(texts[b].step(token))
        if any(pieces):
            yield pieces
        if all(done):
            break
    rest = ["" if done[b] else text.finish() for b, text in enumerate(texts)]
    if any(rest):
        yield rest
    run.stats.finish_reason = "stop" if all(done) else "length"


def _rewind(caches: Sequence[Any], offsets: list[int]) -> None:
    """Trim each cache back to its offset in ``offsets`` where it can (a sliding-window cache
    whose ring wrapped cannot: it stays as the failed step left it)."""
    for c, offset in zip(caches, offsets, strict=True):
        if c.offset > offset:
            with contextlib.suppress(ValueError):
                c.trim(c.offset - offset)
