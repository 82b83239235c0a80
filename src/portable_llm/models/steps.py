""":func:`generate_step`: the decode loop, one ``(token, logprobs)`` per step (mlx-lm's layout).

The prompt runs once through the model (prefill) into the KV caches; each new token then runs
alone (decode). Every step applies the logits processors to the logits of the last position,
takes their log-softmax (the ``logprobs`` yielded) and lets the sampler pick the next id.
:func:`~portable_llm.generate` is the front that adds text, stop tokens and statistics.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from portable_llm.backends import backend_of
from portable_llm.core.arrays import asarray, to_numpy
from portable_llm.core.checks import check_optional_int
from portable_llm.core.types import Array
from portable_llm.models.sampler import LogitsProcessor, Sampler
from portable_llm.ops.sampling import greedy

__all__ = ["PREFILL_STEP_SIZE", "generate_step"]

#: The default prefill chunk (mlx-lm's ``prefill_step_size``): a prompt longer than this runs
#: through the model in chunks of this many tokens, which bounds the prefill's activations
#: (the attention scores of one chunk are ``(B, H, chunk, S)``, not ``(B, H, L, S)``).
PREFILL_STEP_SIZE = 2048


def generate_step(
    model: Any,
    ids: Any,
    /,
    *,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    cache: Sequence[Any] | None = None,
    left_padding: Any = None,
    prefill_step_size: int | None = PREFILL_STEP_SIZE,
) -> Generator[tuple[Any, Array], None, None]:
    """Yield the next token and the log-probabilities it was drawn from, step after step.

    Parameters
    ----------
    model : Model
    ids : sequence or integer array, shape ``(L,)`` or ``(B, L)``
        The prompt (the tokens that follow those ``cache`` holds). ``(B, L)``: a batch,
        left-padded (:func:`~portable_llm.left_pad`) when ``left_padding`` is given.
    sampler : callable, optional
        ``sampler(logits (B, V)) -> ids (B,)`` (:func:`~portable_llm.make_sampler`); default
        :func:`~portable_llm.greedy`.
    logits_processors : sequence of callables
        ``processor(tokens, logits (B, V)) -> logits`` applied in order before the sampler
        (:func:`~portable_llm.make_logits_processors`); ``tokens[b]`` lists row ``b``'s ids so
        far: its prompt (without padding), then the ids generated.
    cache : list of caches, optional
        From ``model.make_cache()``, possibly holding earlier tokens (a prompt cache): it is
        extended in place. Default: a fresh one.
    left_padding : integer array ``(B,)``, optional
        Pad tokens at the start of each row of a 2-D ``ids``; only without ``cache`` (give it
        to ``model.make_cache`` instead).
    prefill_step_size : int, >= 1, optional
        The prompt goes into the caches in chunks of at most this many tokens (default
        :data:`PREFILL_STEP_SIZE`, 2048, as mlx-lm), and only the last chunk's last position
        runs the LM head; ``None``: one chunk. The logits equal those of a one-chunk prefill
        (within the dtype's rounding), and the prefill's peak memory is bounded by the chunk.

    Yields
    ------
    token : int for 1-D ``ids``; NumPy int64 array ``(B,)`` for 2-D ``ids``
    logprobs : array ``(V,)`` or ``(B, V)``, float32 (float64 for float64 logits)
        ``log_softmax`` of the processed logits, on the model's backend.

    The generator never ends by itself: stop iterating when done. Token ``t`` is fed to the
    model only when token ``t + 1`` is asked for, so stopping costs no forward pass.

    Raises
    ------
    ValueError
        On the first step whose logits have no distribution (NaN, or all ``-inf``).
    """
    return decode(
        model, ids, sampler=sampler, logits_processors=logits_processors, cache=cache,
        left_padding=left_padding, logprobs=True,
        prefill_step_size=check_prefill_step_size("generate_step", prefill_step_size),
    )  # fmt: skip


def decode(
    model: Any,
    ids: Any,
    /,
    *,
    sampler: Sampler | None,
    logits_processors: Sequence[LogitsProcessor],
    cache: Sequence[Any] | None,
    left_padding: Any,
    logprobs: bool,
    prefill_step_size: int | None = PREFILL_STEP_SIZE,
) -> Generator[tuple[Any, Array | None], None, None]:
    """:func:`generate_step`'s loop; ``logprobs=False`` yields ``None`` in their place (what
    :func:`~portable_llm.generate` uses: it drops them, and they cost a pass over ``(B, V)``)."""
    bk = model.backend
    host = np.asarray(to_numpy(ids) if backend_of(ids) is not None else ids, dtype=np.int64)
    single = host.ndim == 1
    if single:
        host = host[None]  # (1, L)
    pads = np.zeros(len(host), np.int64) if left_padding is None else to_numpy(left_padding)
    if cache is None:
        cache = model.make_cache(left_padding=left_padding)
    elif left_padding is not None:
        raise ValueError("generate_step: with a cache, give left_padding to make_cache()")
    sampler = greedy if sampler is None else sampler
    # What the processors see: each row's ids without its padding.
    tokens = [row[int(p) :].tolist() for row, p in zip(host, np.reshape(pads, -1), strict=True)]
    prompt_length = host.shape[1]
    start = prefill(model, host, cache, prefill_step_size)
    step_ids = asarray(host[:, start:].tolist(), backend=bk.name, device=model.device)  # (B, L)
    step = 0
    while True:
        logits = model(step_ids, cache=cache, last_only=True)[:, -1, :]  # (B, V)
        for processor in logits_processors:
            logits = processor(tokens, logits)
        lp = _log_softmax(bk.xp, logits) if logprobs else None  # (B, V)
        chosen = bk.to_numpy(sampler(logits)).astype(np.int64).reshape(-1)  # (B,)
        if (chosen < 0).any():  # sample's mark for a row with no distribution
            raise ValueError(
                f"generate: the logits of step {step} (after {prompt_length + step} tokens) are "
                "NaN or all -inf; the weights or the dtype overflowed"
            )
        for row, t in zip(tokens, chosen.tolist(), strict=True):
            row.append(t)
        if single:
            yield int(chosen[0]), None if lp is None else lp[0, ...]
        else:
            yield chosen, lp
        # From Python ints, as the prompt: the backend's default integer dtype (int32 on MLX,
        # where int64 ids made a tiny model's decode ~15% slower).
        step_ids = asarray(chosen[:, None].tolist(), backend=bk.name, device=model.device)
        step += 1


def check_prefill_step_size(op: str, value: Any) -> int | None:
    """``prefill_step_size`` checked: ``None`` or an int >= 1."""
    return check_optional_int(op, "prefill_step_size", value, low=1)


def prefill(model: Any, host: np.ndarray, cache: Sequence[Any], chunk: int | None) -> int:
    """Run all but the last chunk of the prompt ``host`` ``(B, L)`` into ``cache``; return
    where the last chunk starts (``0``: the prompt fits one chunk of ``chunk`` tokens).

    Those chunks need no logits (``last_only``: the head runs on one position) and are
    computed before the next one starts (:meth:`~portable_llm.backends.Backend.synchronize`:
    a lazy library would otherwise hold every chunk's activations at once).
    """
    bk, L = model.backend, host.shape[1]
    start = 0
    while chunk is not None and L - start > chunk:
        part = host[:, start : start + chunk].tolist()  # (B, chunk)
        part = asarray(part, backend=bk.name, device=model.device)
        bk.synchronize(model(part, cache=cache, last_only=True))  # (B, 1, V), dropped
        start += chunk
    return start


def _log_softmax(xp: Any, logits: Array) -> Array:
    """``log_softmax`` over the last axis in float32 (float64 kept): ``x - max - log Σ exp``."""
    x = logits if logits.dtype == xp.float64 else xp.astype(logits, xp.float32)
    top = xp.max(x, axis=-1, keepdims=True)  # (B, 1)
    top = xp.where((top > -math.inf) & (top < math.inf), top, xp.zeros_like(top))
    shifted = x - top
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=-1, keepdims=True))
