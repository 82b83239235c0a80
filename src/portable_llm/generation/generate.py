""":func:`generate`: stream the continuation of a prompt (or of a batch of prompts).

The front of the decode loop :func:`~portable_llm.generate_step` (which yields one
``(token, logprobs)`` per step): it encodes text, makes the sampler
(:func:`~portable_llm.make_sampler`) and the logits processors, streams text with the
tokenizer, and keeps statistics. Generation stops at ``max_new_tokens`` or at a stop token (by
default the ``eos_token_id`` of ``generation_config.json``, else of ``config.json``), which is
not yielded.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from portable_llm.attn.padding import left_pad
from portable_llm.backends import backend_of
from portable_llm.core.arrays import to_numpy
from portable_llm.core.checks import check_int, check_optional_int, check_real
from portable_llm.decoder.model import Model
from portable_llm.generation.sampler import (
    LogitsProcessor,
    Sampler,
    make_logits_processors,
    make_sampler,
)
from portable_llm.generation.steps import PREFILL_STEP_SIZE, check_prefill_step_size, decode

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


def stop_tokens(model: Model) -> tuple[int, ...]:
    """The default stop ids: ``generation_config.json``'s ``eos_token_id``, else config.json's."""
    eos = model.generation_config.get("eos_token_id")
    if eos is None:
        return model.config.eos_token_id
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


def generate(
    model: Model,
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
    repetition_context_size: int = 20,
    prompt_cache: list[Any] | None = None,
    prefill_step_size: int | None = PREFILL_STEP_SIZE,
) -> Generation:
    """Stream the model's continuation of ``prompt``.

    Parameters
    ----------
    model : Model
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
        As for :func:`~portable_llm.make_logits_processors`.
    prompt_cache : list of caches, optional
        ``model.make_cache()``, empty or holding an earlier conversation: the prompt follows
        the tokens it holds, and once the iterator is exhausted it holds the prompt and every
        new token too (a final stop token included), ready for the next turn. Not with a batch.
    prefill_step_size : int, >= 1, optional
        The prompt runs through the model in chunks of at most this many tokens (default
        2048), which bounds the prefill's memory; ``None``: one chunk. As for
        :func:`~portable_llm.generate_step`.

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
    batch = _is_text_batch(prompt)
    text = batch or isinstance(prompt, str)
    if text and model.tokenizer is None:
        raise ValueError("generate: a text prompt needs the checkpoint's tokenizer.json")
    if batch:
        assert model.tokenizer is not None
        rows = [model.tokenizer.encode_prompt(p) for p in prompt]
    elif text:
        assert model.tokenizer is not None
        rows = [model.tokenizer.encode_prompt(prompt)]
    else:
        rows = [_ids(prompt)]
    if not all(rows):
        raise ValueError("generate: the prompt has no tokens")
    V = model.config.vocab_size
    low, high = min(min(r) for r in rows), max(max(r) for r in rows)
    if low < 0 or high >= V:
        raise ValueError(
            f"generate: prompt token ids must lie in [0, {V}) (vocab_size), got {low} to {high}"
        )
    max_new_tokens = check_int(OP, "max_new_tokens", max_new_tokens, low=0)
    options = _sampling_options(temperature, top_k, top_p, min_p, V)
    seed = check_optional_int(OP, "seed", seed, low=0)
    stops = frozenset(stop_tokens(model) if stop is None else _stop_ids(stop))
    processors = make_logits_processors(
        repetition_penalty=_penalty(repetition_penalty),
        repetition_context_size=check_int(
            OP, "repetition_context_size", repetition_context_size, low=1
        ),
    )
    if prompt_cache is not None and batch:
        raise ValueError("generate: prompt_cache is for one prompt, not a batch")
    if prompt_cache is not None and len(prompt_cache) != model.config.num_hidden_layers:
        raise ValueError(
            f"generate: prompt_cache must hold one cache per layer "
            f"({model.config.num_hidden_layers}, from model.make_cache()), got {len(prompt_cache)}"
        )
    chunk = check_prefill_step_size(OP, prefill_step_size)
    stats = GenerationStats(prompt_tokens=sum(len(r) for r in rows))
    run = _Run(model, make_sampler(**options, seed=seed), processors, stops, stats, chunk)
    if batch:
        assert model.tokenizer is not None
        return Generation(_batch_pieces(run, rows, max_new_tokens, model.tokenizer), stats)
    tokens = run.tokens(rows[0], max_new_tokens, prompt_cache)
    if text:
        assert model.tokenizer is not None
        return Generation(model.tokenizer.stream(tokens), stats)
    return Generation(tokens, stats)


def _is_text_batch(prompt: Any) -> bool:
    return (
        isinstance(prompt, list | tuple)
        and len(prompt) > 0
        and all(isinstance(p, str) for p in prompt)
    )


def _penalty(value: Any) -> float | None:
    if value is None:
        return None
    return check_real(OP, "repetition_penalty", value, low=0, low_open=True)


@dataclass
class _Run:
    """What one generation needs beside its prompt: model, sampler, processors, stops, stats."""

    model: Model
    sampler: Sampler
    processors: list[LogitsProcessor]
    stops: frozenset[int]
    stats: GenerationStats
    prefill_step_size: int | None = PREFILL_STEP_SIZE

    def _timed(self, steps: Iterator[tuple[Any, Any]], step: int) -> Any:
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
        for step in range(max_new_tokens):
            last = self._timed(steps, step)
            if last in stops:
                stats.stop_token = last
                break
            stats.generated_tokens += 1
            yield last
        stats.finish_reason = "length" if stats.stop_token is None else "stop"
        steps.close()
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
    texts = [tokenizer.stream_decoder() for _ in rows]
    done = [False] * len(rows)
    for step in range(max_new_tokens):
        chosen = run._timed(steps, step)
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
    steps.close()


def _sampling_options(
    temperature: Any, top_k: Any, top_p: Any, min_p: Any, vocab: int
) -> dict[str, Any]:
    """:func:`~portable_llm.sample`'s options, checked as it checks them, as Python numbers."""
    top_p = None if top_p is None else check_real(OP, "top_p", top_p, low=0, low_open=True, high=1)
    return {
        "temperature": check_real(OP, "temperature", temperature, low=0),
        "top_k": check_optional_int(OP, "top_k", top_k, low=1, high=vocab),
        "top_p": top_p,
        "min_p": None if min_p is None else check_real(OP, "min_p", min_p, low=0, high=1),
    }


def _stop_ids(stop: Any) -> list[int]:
    if not isinstance(stop, str | bytes) and backend_of(stop) is not None:  # an array of ids
        stop = to_numpy(stop).reshape(-1).tolist()
    if isinstance(stop, str | bytes) or not isinstance(stop, Iterable):
        raise TypeError(
            f"generate: stop must be an iterable of token ids (ints) or None, got "
            f"{type(stop).__name__} {stop!r}"
        )
    return [check_int(OP, f"stop[{i}]", s) for i, s in enumerate(stop)]


def _ids(prompt: Any) -> list[int]:
    if backend_of(prompt) is not None:
        prompt = to_numpy(prompt)
    accepted = "a str, a 1-D sequence of token ids (ints) or a 1-D integer array"
    try:
        arr = np.asarray(prompt)
    except ValueError:  # ragged nesting: NumPy's "inhomogeneous shape"
        raise ValueError(
            f"generate: prompt must be {accepted}, got a ragged nested {type(prompt).__name__}"
        ) from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(
            f"generate: prompt must be {accepted}, got shape {arr.shape} of {arr.dtype}"
        )
    return [int(i) for i in arr]
