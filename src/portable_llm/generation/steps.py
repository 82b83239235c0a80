""":func:`generate_step`: the decode loop, one ``(token, logprobs)`` per step (mlx-lm's layout).

The prompt runs once through the model (prefill) into the KV caches; each new token then runs
alone (decode). Every step applies the logits processors to the logits of the last position,
takes their log-softmax (the ``logprobs`` yielded) and lets the sampler pick the next id.
:func:`~portable_llm.generate` is the front that adds text, stop tokens and statistics.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from portable_llm.backends import Backend, backend_of
from portable_llm.core.arrays import to_numpy
from portable_llm.core.checks import check_optional_int
from portable_llm.core.dispatch import pick
from portable_llm.core.types import Array
from portable_llm.generation.prompt import batch_ids
from portable_llm.generation.protocol import (
    LanguageModel,
    array_library,
    check_cache_list,
    check_logits,
    check_model,
    decode_step,
    materialize,
    recompute_after,
    release_cache,
    vocab_size,
)
from portable_llm.generation.sampler import LogitsProcessor, Sampler
from portable_llm.ops.sampling import greedy

__all__ = ["PREFILL_STEP_SIZE", "generate_step"]

#: The default prefill chunk (mlx-lm's ``prefill_step_size``): a prompt longer than this runs
#: through the model in chunks of this many tokens, which bounds the prefill's activations
#: (the attention scores of one chunk are ``(B, H, chunk, S)``, not ``(B, H, L, S)``).
PREFILL_STEP_SIZE = 2048


def generate_step(
    model: LanguageModel,
    ids: Any,
    /,
    *,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    cache: Sequence[Any] | None = None,
    left_padding: Any = None,
    prefill_step_size: int | None = PREFILL_STEP_SIZE,
) -> Iterator[tuple[Any, Array]]:
    """Yield the next token and the log-probabilities it was drawn from, step after step.

    Parameters
    ----------
    model : LanguageModel
        A :class:`~portable_llm.Model`, or any object that follows
        :class:`~portable_llm.generation.LanguageModel` (``docs/bring-your-own-model.md``).
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

    The iterator never ends by itself: stop iterating when done (its ``close()`` hands caches
    it made back to a model's ``release_cache``, :class:`~portable_llm.generation.
    ReleasingModel`). On NumPy,
    array-api-strict, torch's CPU and MLX's CPU, token ``t`` is fed to the model only when token
    ``t + 1`` is asked for, so stopping costs no forward pass. Where queuing ahead pays
    (:meth:`Backend.pipelines <portable_llm.backends.Backend.pipelines>`: JAX, MLX on a GPU,
    torch on CUDA or MPS) and there are no ``logits_processors``, step ``t + 1`` is queued
    before token ``t`` is read back (mlx-lm's pipelining): the device computes while the host
    yields, and the caches already hold token ``t`` when it is yielded.

    Raises
    ------
    TypeError
        ``model`` lacks a member of :class:`~portable_llm.generation.LanguageModel`.
    ValueError
        On the first step whose logits have no distribution (NaN, or all ``-inf``), or whose
        sampler gave other than one id in ``[0, V)`` per row.
    """
    return decode(
        model, ids, sampler=sampler, logits_processors=logits_processors, cache=cache,
        left_padding=left_padding, logprobs=True,
        prefill_step_size=check_prefill_step_size("generate_step", prefill_step_size),
    )  # fmt: skip


def decode(
    model: LanguageModel,
    ids: Any,
    /,
    *,
    sampler: Sampler | None,
    logits_processors: Sequence[LogitsProcessor],
    cache: Sequence[Any] | None,
    left_padding: Any,
    logprobs: bool,
    prefill_step_size: int | None = PREFILL_STEP_SIZE,
    max_tokens: int | None = None,
) -> Decode:
    """:func:`generate_step`'s loop; ``logprobs=False`` yields ``None`` in their place (what
    :func:`~portable_llm.generate` uses: it drops them, and they cost a pass over ``(B, V)``).
    ``max_tokens``: no step is queued for a token past this many."""
    model = check_model("generate_step", model)
    fresh = cache is None  # made here: generation may make it again (RecomputingModel)
    host, single = batch_ids(model, ids)  # (B, L)
    pads = np.zeros(len(host), np.int64)
    if left_padding is not None:
        pads = np.asarray(to_numpy(left_padding) if backend_of(left_padding) else left_padding)
        if (
            pads.shape != (len(host),)
            or pads.dtype.kind not in "iu"
            or not ((pads >= 0) & (pads < host.shape[1])).all()
        ):
            raise ValueError(
                f"generate_step: left_padding must be {len(host)} ints in [0, L) = [0, "
                f"{host.shape[1]}) (each row keeps a token) for ids of shape {host.shape}, got "
                f"{pads.tolist() if pads.size <= 8 else pads.shape} of {pads.dtype}"
            )
    if cache is None:
        cache = (
            model.make_cache()
            if left_padding is None
            else model.make_cache(left_padding=left_padding)
        )
    elif left_padding is not None:
        raise ValueError("generate_step: with a cache, give left_padding to make_cache()")
    else:
        cache = check_cache_list("generate_step", "cache", cache, model)
    # What the processors see: each row's ids without its padding.
    tokens = [row[int(p) :].tolist() for row, p in zip(host, np.reshape(pads, -1), strict=True)]
    return Decode(
        model, host, cache, single=single, sampler=sampler, processors=list(logits_processors),
        tokens=tokens, logprobs=logprobs, prefill_step_size=prefill_step_size,
        max_tokens=max_tokens, recompute=recompute_after(model) if fresh else None,
        left_padding=left_padding, fresh=fresh,
    )  # fmt: skip


class Decode:
    """The decode loop as an iterator of ``(token, logprobs)`` (see :func:`generate_step`).

    Per token it runs the forward (:func:`~portable_llm.generation.protocol.decode_step`, e.g.
    :meth:`Model.decode_step <portable_llm.Model.decode_step>`: the sampler's ids go back in on
    the device, unchecked and never through the host), the
    processors and the sampler, and reads the chosen ids to the host once (``to_numpy``, with
    greedy's row maxima): the yielded token, the no-distribution check and the caller's stop
    checks all use that read.

    Where that pays (:meth:`Backend.pipelines <portable_llm.backends.Backend.pipelines>`: JAX,
    MLX on a GPU, torch on CUDA or MPS) and no logits processor needs the host's ids, step
    ``t + 1`` is queued (:meth:`~portable_llm.backends.Backend.launch`) before token ``t`` is
    read back, so the host builds the next step while the device computes this one (mlx-lm's
    pipelining); the caches then already hold token ``t`` when it is yielded.

    The backend and device are those of the prefill's logits (a model states neither).

    ``recompute`` (:class:`~portable_llm.generation.protocol.RecomputingModel`, caches made
    here): the step that makes the sequence ``recompute + 1`` tokens long runs every token
    again into fresh caches (transformers' Phi-3 generation with ``longrope``), and a longer
    prompt is prefilled in one forward, as transformers does.
    """

    def __init__(
        self, model: LanguageModel, host: np.ndarray, cache: Sequence[Any], *, single: bool,
        sampler: Sampler | None, processors: list[LogitsProcessor], tokens: list[list[int]],
        logprobs: bool, prefill_step_size: int | None, max_tokens: int | None,
        recompute: int | None = None, left_padding: Any = None, fresh: bool = False,
    ) -> None:  # fmt: skip
        self.model, self.host, self.cache, self.single = model, host, cache, single
        self.recompute = recompute if recompute is not None and recompute >= host.shape[1] else None
        if recompute is not None and recompute < host.shape[1]:
            prefill_step_size = None  # the long prompt in one forward, as transformers
        self.left_padding = left_padding
        self.seen: list[np.ndarray] = [host]  # the ids fed, while a recompute may come
        self.fed = host.shape[1]  # tokens in the caches once the prompt is in
        self.decode_step = decode_step(model)
        self.vocab = vocab_size(model)  # None: the prefill's logits tell
        self.fresh = fresh  # the caches were made here: close() releases them
        self.sampler = sampler
        self.processors, self.tokens, self.logprobs = processors, tokens, logprobs
        self.chunk, self.max_tokens = prefill_step_size, max_tokens
        # Set by the prefill, from its logits: the backend, queuing ahead, the ids' dtype.
        self.bk: Backend | None = None
        self.pipelined = False
        self.index: Any = None  # the default integer (int32 on MLX)
        #: Tokens yielded so far.
        self.step = 0
        self._next: tuple[Any, Any, Any] | None = None  # token t: _sample()'s, queued
        self._unfed: Any = None  # the last yielded ids (B, 1), not yet in the caches

    def __iter__(self) -> Decode:
        return self

    def __next__(self) -> tuple[Any, Array | None]:
        if self._next is None:
            self._next = self._prefill() if self.step == 0 else self._forward(self._unfed)
        ids, top, lp = self._next  # ids (B, 1): fed to the next step as they are
        self._next, self._unfed = None, ids
        bk = self.bk
        assert bk is not None
        if self.pipelined and (self.max_tokens is None or self.step + 1 < self.max_tokens):
            queued = self._forward(self._unfed)  # step t + 1, queued before t is read
            bk.launch([a for a in queued if a is not None])
            self._next, self._unfed = queued, None
        chosen = bk.to_numpy(ids).reshape(-1).tolist()  # (B,): the step's host read
        # No distribution: greedy's row maximum is NaN or -inf; a sampler marks the row -1.
        if not (bk.to_numpy(top) > -math.inf).all() if top is not None else -1 in chosen:
            raise ValueError(
                f"generate: the logits of step {self.step} (after "
                f"{self.host.shape[1] + self.step} tokens) are NaN or all -inf; the weights or "
                "the dtype overflowed"
            )
        low, high = min(chosen), max(chosen)  # any other id outside the vocabulary: drawn so
        if low < 0 or (self.vocab is not None and high >= self.vocab):
            raise ValueError(
                f"generate: the sampler of step {self.step} drew {low if low < 0 else high}, "
                f"outside [0, {'V' if self.vocab is None else self.vocab}) (vocab_size)"
            )
        if self.processors:
            for row, t in zip(self.tokens, chosen, strict=True):
                row.append(t)
        if self.recompute is not None:
            self.seen.append(np.asarray(chosen, dtype=np.int64)[:, None])  # (B, 1)
        self.step += 1
        if self.single:
            return chosen[0], None if lp is None else lp[0, ...]
        return np.asarray(chosen, dtype=np.int64), lp

    def close(self) -> None:
        """Stop: nothing is held (a queued step's tokens are in the caches already); caches
        made here go back to the model (:func:`~portable_llm.generation.protocol.
        release_cache`)."""
        self._next = None
        if self.fresh:
            self.fresh = False
            release_cache(self.model, self.cache)

    def feed_last(self) -> None:
        """Put the last token yielded into the caches where no step has yet (after the
        limit, or on a backend that feeds a token only when the next one is asked for); before
        the first token, the prompt. The caches then hold every token seen."""
        if self.step == 0:
            start = prefill(self.model, self.host, self.cache, self.chunk)
            self.model(self.host[:, start:], cache=self.cache, last_only=True)
        elif self._unfed is not None:
            self._step_logits(self._unfed)
            self._unfed = None

    def _prefill(self) -> tuple[Any, Any, Any]:
        model = self.model
        start = prefill(model, self.host, self.cache, self.chunk)
        out = model(self.host[:, start:], cache=self.cache, last_only=True)
        if self.vocab is None:  # a model without vocab_size: V from its first logits
            self.vocab = int(out.shape[-1]) if array_library(out) is not None else None
        logits = self._checked(out, "__call__")[:, -1, :]  # (B, V)
        bk = backend_of(logits)
        assert bk is not None
        self.bk = bk
        self.pipelined = not self.processors and bk.pipelines(bk.device_of(logits))
        self.index = bk.xp.asarray(0).dtype
        return self._sample(logits)

    def _forward(self, ids: Any) -> tuple[Any, Any, Any]:
        """Logits of ``ids`` ``(B, 1)`` (the sampler's ids, on the device), sampled."""
        logits = self._checked(self._step_logits(ids), "decode_step")[:, -1, :]  # (B, V)
        return self._sample(logits)

    def _checked(self, logits: Any, call: str) -> Any:
        """The model's logits ``(B, L | 1, V)``, checked (:func:`check_logits`)."""
        shape = (len(self.host), None, self.vocab)
        return check_logits("generate", self.model, logits, shape, call)

    def _step_logits(self, ids: Any) -> Any:
        """The decode step of ``ids`` ``(B, 1)``; at the recompute length, every token again
        into fresh caches (one host read of ``ids``)."""
        if self.recompute is None or self.fed < self.recompute:
            if self.recompute is not None:
                self.fed += 1
            return self.decode_step(ids, cache=self.cache)
        seen = np.concatenate(self.seen, axis=1)[:, : self.fed]  # (B, L0): what the caches hold
        assert self.bk is not None
        new = np.asarray(self.bk.to_numpy(ids), dtype=np.int64).reshape(-1, 1)  # (B, 1)
        pad = {} if self.left_padding is None else {"left_padding": self.left_padding}
        assert isinstance(self.cache, list)
        release_cache(self.model, list(self.cache))
        self.cache[:] = self.model.make_cache(**pad)
        self.recompute, self.seen = None, []
        return self.model(np.concatenate([seen, new], axis=1), cache=self.cache, last_only=True)

    def _sample(self, logits: Any) -> tuple[Any, Any, Any]:
        """``(ids (B, 1), row maxima (B,) or None, logprobs (B, V) or None)``, on the device.

        Greedy (the default) and the log-probabilities are the kernels of
        :func:`~portable_llm.greedy` and :func:`~portable_llm.ops.sampling.log_softmax`, asked
        of the dispatcher (a trace records them); a row with no distribution (NaN or ``-inf``
        throughout) gets id ``-1``, as from any sampler. The row maxima slot stays ``None``.
        """
        assert self.bk is not None
        bk = self.bk
        xp = bk.xp
        if tuple(logits.shape) != (len(self.host), self.vocab):
            raise ValueError(
                f"generate: the model's logits of step {self.step} have shape "
                f"{tuple(logits.shape)} at the last position, expected (B, V) = "
                f"({len(self.host)}, {self.vocab}) (vocab_size)"
            )
        for processor in self.processors:
            logits = processor(self.tokens, logits)
        lp = None
        if self.logprobs:
            lp = pick(bk, "log_softmax", "auto", logits)(xp, logits)  # (B, V)
        if self.sampler is None or self.sampler is greedy:
            ids = pick(bk, "greedy", "auto", logits)(xp, logits)  # (B,) the default int dtype
            return xp.reshape(ids, (-1, 1)), None, lp
        drawn = self.sampler(logits)
        kind = array_library(drawn)
        if kind is not bk or not bk.dtype_name(drawn.dtype).startswith(("int", "uint")):
            what = "" if kind is None else f" ({kind.name}, {kind.dtype_name(drawn.dtype)})"
            raise TypeError(
                f"generate: the sampler must return an integer array of the logits' library "
                f"({bk.name}), shape (B,) = ({len(self.host)},); got {type(drawn).__name__}"
                f"{what} {repr(drawn)[:40]}"
            )
        if tuple(drawn.shape) != (len(self.host),):
            raise ValueError(
                f"generate: the sampler must return ids of shape (B,) = ({len(self.host)},) for "
                f"logits of shape {tuple(logits.shape)}, got shape {tuple(drawn.shape)}"
            )
        return xp.reshape(drawn, (-1, 1)), None, lp


def check_prefill_step_size(op: str, value: Any) -> int | None:
    """``prefill_step_size`` checked: ``None`` or an int >= 1."""
    return check_optional_int(op, "prefill_step_size", value, low=1)


def prefill(model: LanguageModel, host: np.ndarray, cache: Sequence[Any], chunk: int | None) -> int:
    """Run all but the last chunk of the prompt ``host`` ``(B, L)`` into ``cache``; return
    where the last chunk starts (``0``: the prompt fits one chunk of ``chunk`` tokens).

    Those chunks need no logits (``last_only``: the head runs on one position) and are
    computed before the next one starts (:func:`~portable_llm.generation.protocol.materialize`:
    the model's ``materialize(cache)``, else the backend's ``synchronize``; a lazy library
    would otherwise hold every chunk's activations at once).
    """
    L = host.shape[1]
    start = 0
    while chunk is not None and L - start > chunk:
        out = model(host[:, start : start + chunk], cache=cache, last_only=True)  # dropped
        materialize(model, out, cache)
        start += chunk
    return start
