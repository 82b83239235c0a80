"""Samplers and logits processors for :func:`~portable_llm.generate_step` (mlx-lm's layout).

A *sampler* maps the logits of one step ``(B, V)`` to the chosen ids ``(B,)`` (on the logits'
backend and device); a *logits processor* maps ``(tokens, logits)`` to new logits, where
``tokens`` holds, per row, the ids seen so far (the prompt's, then the generated ones).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from portable_llm.backends import backend_of
from portable_llm.core.checks import check_optional_int, check_real
from portable_llm.core.types import Array
from portable_llm.generation.penalties import Penalties, PenaltyProcessor
from portable_llm.generation.prompt import stop_ids
from portable_llm.ops.penalties import apply_penalties
from portable_llm.ops.sampling import GREEDY_BELOW, greedy, sample

__all__ = ["LogitsProcessor", "Sampler", "make_logits_processors", "make_sampler"]

#: ``sampler(logits (B, V)) -> ids (B,)``.
Sampler = Callable[[Array], Array]
#: ``processor(tokens, logits (B, V)) -> logits (B, V)``; ``tokens[b]``: row b's ids so far.
LogitsProcessor = Callable[[Sequence[Sequence[int]], Array], Array]


def make_sampler(
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
) -> Sampler:
    """A sampler: :func:`~portable_llm.greedy` at ``temperature=0``, else
    :func:`~portable_llm.sample` with these filters.

    Parameters
    ----------
    temperature, top_k, top_p, min_p
        As for :func:`portable_llm.sample` (``top_k`` is checked against the vocabulary when
        the sampler runs).
    seed : int, >= 0, optional
        Reproducible draws: call ``t`` of the sampler draws with the int seed
        ``numpy.random.default_rng(seed).integers(0, 2**63)`` (the ``t``-th of that
        sequence), passed to :func:`~portable_llm.sample` as its ``key``, so call ``t`` uses the
        backend's generator seeded with it. ``None``: fresh entropy.

    Returns
    -------
    callable
        ``sampler(logits)``: logits ``(B, V)`` (or ``(V,)``) to ids ``(B,)`` (``()``), the
        backend's default integer dtype; ``-1`` for a row with no distribution (NaN logits).
    """
    op = "make_sampler"
    temperature = check_real(op, "temperature", temperature, low=0)
    top_k = check_optional_int(op, "top_k", top_k, low=1)
    top_p = None if top_p is None else check_real(op, "top_p", top_p, low=0, low_open=True, high=1)
    min_p = None if min_p is None else check_real(op, "min_p", min_p, low=0, high=1)
    seed = check_optional_int(op, "seed", seed, low=0)
    if temperature < GREEDY_BELOW:
        return greedy
    seeds = np.random.default_rng(seed)
    options: dict[str, Any] = {
        "temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
    }  # fmt: skip

    def sampler(logits: Array) -> Array:
        return sample(logits, key=int(seeds.integers(0, 2**63)), **options)

    return sampler


def make_logits_processors(
    *,
    repetition_penalty: float | None = None,
    repetition_context_size: int | None = 20,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    stop: Iterable[int] = (),
    vocab_size: int | None = None,
) -> list[LogitsProcessor]:
    """The logits processors these options ask for (an empty list: none).

    Parameters
    ----------
    repetition_penalty : float, > 0, optional
        CTRL's penalty, as transformers and mlx-lm apply it: the logit ``x`` of each token among
        a row's last ``repetition_context_size`` ids becomes ``x * penalty`` if ``x < 0``, else
        ``x / penalty``. ``None`` or ``1``: no penalty.
    repetition_context_size : int, >= 1, or None
        How many of the latest ids (prompt included) count as seen (mlx-lm's default: 20).
        ``None``: every id of the prompt and the output (transformers' and vLLM's rule, as
        :class:`~portable_llm.BatchGenerator` requests and the server apply it).
    frequency_penalty, presence_penalty : float in ``[-2, 2]``
    logit_bias : mapping of token id to float in ``[-100, 100]``, optional
    min_tokens : int, >= 0
        The ``stop`` ids get ``-inf`` until this many tokens were generated.
    stop : iterable of int
        The tokens ``min_tokens`` bans (:func:`~portable_llm.generate` passes its stop ids).
    vocab_size : int, optional
        Checks the ids of ``logit_bias`` now; without it, at the first call.

    These (but the windowed repetition penalty) run as one
    :class:`~portable_llm.generation.penalties.PenaltyProcessor`: every row at once with
    :func:`~portable_llm.apply_penalties`, the counts of each row's tokens kept on the device.
    """
    op = "make_logits_processors"
    context = check_optional_int(op, "repetition_context_size", repetition_context_size, low=1)
    penalties = Penalties.check(
        op, vocab_size=vocab_size,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        repetition_penalty=1.0 if context is not None else repetition_penalty,
        logit_bias=logit_bias, min_tokens=min_tokens,
    )  # fmt: skip
    processors: list[LogitsProcessor] = []
    if repetition_penalty is not None and context is not None:
        penalty = check_real(op, "repetition_penalty", repetition_penalty, low=0, low_open=True)
        if penalty != 1:
            processors.append(_repetition_penalty(penalty, context))
    if not penalties.neutral:
        processors.append(PenaltyProcessor(penalties, stop_ids(None, stop, op=op)))
    return processors


def _repetition_penalty(penalty: float, context: int) -> LogitsProcessor:
    def processor(tokens: Sequence[Sequence[int]], logits: Array) -> Array:
        bk = backend_of(logits)
        assert bk is not None, "repetition_penalty: logits must be an array"
        xp = bk.xp
        B, V = logits.shape  # (B, V)
        seen = np.zeros((B, V), dtype=bool)
        for b, row in enumerate(tokens):
            ids = np.asarray(list(row)[-context:], dtype=np.int64)
            seen[b, ids[(ids >= 0) & (ids < V)]] = True
        mask = bk.from_numpy(seen, bk.device_of(logits))  # (B, V)
        counts = xp.zeros(logits.shape, dtype=xp.int32, device=bk.device_of(logits))
        return apply_penalties(logits, counts, prompt_mask=mask, repetition_penalty=penalty)

    return processor
