""":func:`generate`: stream the continuation of a prompt, token by token.

The prompt runs once through the model (prefill) into a KV cache; then each new token runs alone
(decode), and is chosen by :func:`portable_llm.sample` (or :func:`portable_llm.greedy` at
temperature 0). Generation stops at ``max_new_tokens`` or at a stop token (by default the
``eos_token_id`` of ``generation_config.json``, else of ``config.json``), which is not yielded.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from portable_llm.backends import backend_of
from portable_llm.core.arrays import asarray, to_numpy
from portable_llm.core.checks import check_int, check_optional_int, check_real
from portable_llm.models.model import Model
from portable_llm.ops.sampling import sample

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
    prompt: str | Sequence[int] | Any,
    /,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: Iterable[int] | None = None,
) -> Generation:
    """Stream the model's continuation of ``prompt``.

    Parameters
    ----------
    model : Model
    prompt : str, or a sequence or 1-D array of token ids
        A string is encoded with the model's tokenizer, and the iterator yields text pieces
        (whose concatenation is the decoded continuation). Token ids (of any backend) make the
        iterator yield token ids (``int``).
    max_new_tokens : int, >= 0
    temperature, top_k, top_p, min_p
        As for :func:`portable_llm.sample`; ``temperature=0`` (the default) is greedy.
        ``top_k`` in ``[1, vocab_size]``.
    seed : int, >= 0, optional
        Makes sampling reproducible on a backend: the draw of step ``t`` uses a seed derived
        from ``seed`` and ``t``. ``None``: fresh entropy.
    stop : iterable of int, optional
        Stop token ids; default :func:`stop_tokens` (the checkpoint's EOS ids). ``()``: none.

    Every argument is checked here, when ``generate`` is called, before the model runs
    (integers may be Python or NumPy integers, never ``bool``): a bad one is a ``TypeError``
    or ``ValueError`` naming it, not an error after the prefill.

    Returns
    -------
    Generation
        An iterator; its ``stats`` (:class:`GenerationStats`) holds the prompt length, the
        prefill time (up to the first new token), the tokens generated and the decode time.
    """
    text = isinstance(prompt, str)
    if text:
        if model.tokenizer is None:
            raise ValueError("generate: a text prompt needs the checkpoint's tokenizer.json")
        ids = model.tokenizer.encode(prompt)
    else:
        ids = _ids(prompt)
    if not ids:
        raise ValueError("generate: the prompt has no tokens")
    V = model.config.vocab_size
    if min(ids) < 0 or max(ids) >= V:
        raise ValueError(
            f"generate: prompt token ids must lie in [0, {V}) (vocab_size), got {min(ids)} "
            f"to {max(ids)}"
        )
    max_new_tokens = check_int(OP, "max_new_tokens", max_new_tokens, low=0)
    options = _sampling_options(temperature, top_k, top_p, min_p, V)
    seed = check_optional_int(OP, "seed", seed, low=0)
    stops = frozenset(stop_tokens(model) if stop is None else _stop_ids(stop))
    stats = GenerationStats(prompt_tokens=len(ids))
    tokens = _tokens(model, ids, max_new_tokens, options, seed, stops, stats)
    if text:
        assert model.tokenizer is not None
        return Generation(model.tokenizer.stream(tokens), stats)
    return Generation(tokens, stats)


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


def _tokens(
    model: Model,
    ids: list[int],
    max_new_tokens: int,
    options: dict[str, Any],
    seed: int | None,
    stops: frozenset[int],
    stats: GenerationStats,
) -> Iterator[int]:
    """The new token ids, one at a time; fills ``stats`` as it goes."""
    bk = model.backend
    seeds = np.random.default_rng(seed)
    cache = model.make_cache()
    step_ids = asarray([ids], backend=bk.name, device=model.device)  # (1, L)
    for step in range(max_new_tokens):
        start = time.perf_counter()
        logits = model(step_ids, cache=cache, last_only=True)[:, -1, :]  # (1, V)
        key = None if options["temperature"] == 0 else int(seeds.integers(0, 2**63))
        token = int(bk.to_numpy(sample(logits, key=key, **options))[0])
        if token < 0:  # sample's mark for a row with no distribution (NaN or all -inf logits)
            raise ValueError(
                f"generate: the logits of step {step} (after {len(ids) + step} tokens) are NaN "
                "or all -inf; the weights or the dtype overflowed"
            )
        elapsed = time.perf_counter() - start
        if step == 0:
            stats.prefill_seconds = elapsed
        else:
            stats.decode_steps += 1
            stats.decode_seconds += elapsed
        if token in stops:
            stats.stop_token = token
            return
        stats.generated_tokens += 1
        yield token
        step_ids = asarray([[token]], backend=bk.name, device=model.device)  # (1, 1)
