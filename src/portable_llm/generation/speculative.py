""":func:`speculative_generate`: a small draft model proposes, the target verifies in one forward.

Each round the draft proposes ``k`` tokens one at a time; the target runs the last accepted
token and the ``k`` proposals in one forward (``last_only=False``: ``k + 1`` distributions), and
keeps the longest prefix it accepts plus one token of its own (the correction at the first
rejection, or a bonus token when it accepts all). Both caches then forget the rejected tokens
(:meth:`~portable_llm.KVCache.trim`). Greedy: a proposal is accepted when it is the target's
argmax, so the output is the target's greedy output token for token. Sampling: Leviathan et al.
(2023)'s rule, whose output has the target's distribution exactly (see ``docs/speculative.md``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from portable_llm.backends import Backend, backend_of
from portable_llm.caches.hybrid import HybridCache, attention_cache, recurrent_cache
from portable_llm.caches.kv import KVCache, RotatingKVCache
from portable_llm.core.arrays import asarray, to_numpy
from portable_llm.core.checks import check_int, check_optional_int
from portable_llm.core.types import Array
from portable_llm.generation.generate import Generation, GenerationStats
from portable_llm.generation.prompt import is_text_batch, prompt_ids, sampling_options, stop_ids
from portable_llm.generation.protocol import (
    LanguageModel,
    check_logits,
    check_model,
    release_cache,
    rewind_cache,
    vocab_size,
)
from portable_llm.generation.steps import PREFILL_STEP_SIZE, check_prefill_step_size, prefill
from portable_llm.generation.tokenizer import check_same_tokenizer, text_tokenizer
from portable_llm.ops.sampling import GREEDY_BELOW, greedy, logprobs, sample

__all__ = ["SpeculativeStats", "speculative_generate"]

OP = "speculative_generate"


@dataclass
class SpeculativeStats(GenerationStats):
    """:class:`~portable_llm.models.GenerationStats` plus the draft's record.

    ``decode_steps`` counts the tokens decoded after the first (a final stop token included),
    as :func:`~portable_llm.generate` does, so ``decode_tokens_per_second`` compares with it;
    the target's forwards are :attr:`rounds`.
    """

    #: Tokens the draft proposed.
    draft_tokens: int = 0
    #: Proposals the target accepted.
    accepted_tokens: int = 0
    #: Verifying forwards of the target after the prefill.
    rounds: int = 0

    @property
    def acceptance_rate(self) -> float:
        """``accepted_tokens / draft_tokens`` (``0.0`` before any proposal)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0


def speculative_generate(
    model: LanguageModel,
    draft_model: LanguageModel,
    prompt: str | Sequence[int] | Any,
    /,
    *,
    num_draft_tokens: int = 4,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stop: Iterable[int] | None = None,
    prefill_step_size: int | None = PREFILL_STEP_SIZE,
) -> Generation:
    """Stream ``model``'s continuation of ``prompt``, with ``draft_model`` proposing tokens.

    Parameters
    ----------
    model : LanguageModel
        The target: the output is its greedy output (``temperature=0``), or has its sampling
        distribution. A :class:`~portable_llm.Model`, or any object that follows
        :class:`~portable_llm.generation.LanguageModel` whose caches rewind (``trim(n)``).
    draft_model : LanguageModel
        A cheaper model with the same vocabulary (same ``vocab_size``, and the same token ids
        when both have a tokenizer); any backend.
    prompt : str, or a sequence or 1-D array of token ids
        As for :func:`~portable_llm.generate` (one prompt, not a batch): text yields text
        pieces, ids yield ids (``int``).
    num_draft_tokens : int, >= 0
        Proposals per round, ``k``: the target verifies ``k + 1`` tokens per forward. ``0`` is
        plain decoding by the target (the draft never runs).
    max_new_tokens, temperature, top_k, top_p, min_p, seed, stop, prefill_step_size
        As for :func:`~portable_llm.generate`. The filters apply to both models' logits (the
        transform of :func:`~portable_llm.sample`), and the acceptance rule compares the
        filtered distributions. ``seed``: every draw (proposals, acceptance tests, corrections)
        comes from a seed of ``numpy.random.default_rng(seed)``, as in
        :func:`~portable_llm.make_sampler`.

    Returns
    -------
    Generation
        An iterator; its ``stats`` is a :class:`SpeculativeStats` (``acceptance_rate``).

    Raises
    ------
    ValueError
        Before running: the vocabularies differ, a bad option (as :func:`generate`).

    Notes
    -----
    Both models' caches come from their ``make_cache()``, each rewound with ``trim(n)``; a
    :class:`~portable_llm.RotatingKVCache` there (a sliding-window layer) is replaced by a
    :class:`~portable_llm.KVCache`, whose mask applies the window: a ring cannot rewind more
    than one token once it wrapped.
    """
    model = check_model(OP, model, rewinds=True)
    draft_model = check_model(OP, draft_model, rewinds=True)
    text = isinstance(prompt, str)
    _check_pair(model, draft_model)
    if is_text_batch(prompt):
        raise ValueError(f"{OP}: prompt must be one prompt (str or token ids), not a batch")
    ids = prompt_ids(model, prompt, op=OP)
    V = vocab_size(model)  # None: the target's first logits tell
    run = _Speculation(
        model=model,
        draft=draft_model,
        k=check_int(OP, "num_draft_tokens", num_draft_tokens, low=0),
        options=sampling_options(temperature, top_k, top_p, min_p, vocab_size=V, op=OP),
        keys=np.random.default_rng(check_optional_int(OP, "seed", seed, low=0)),
        chunk=check_prefill_step_size(OP, prefill_step_size),
        stats=SpeculativeStats(prompt_tokens=len(ids)),
    )
    stops = stop_ids(model, stop, op=OP)
    max_new_tokens = check_int(OP, "max_new_tokens", max_new_tokens, low=0)
    tokens = run.tokens(ids, max_new_tokens, stops)
    if text:  # prompt_ids refused text without a tokenizer
        return Generation(text_tokenizer(model.tokenizer).stream(tokens), run.stats)
    return Generation(tokens, run.stats)


def _check_pair(model: LanguageModel, draft: LanguageModel) -> None:
    """The draft's ids must mean the target's: the same ``vocab_size`` (where both state one;
    else the same ``V`` in their first logits, checked then) and the same tokenizer
    (:func:`~portable_llm.generation.tokenizer.check_same_tokenizer`, any two tokenizers)."""
    vm, vd = vocab_size(model), vocab_size(draft)
    if vm is not None and vd is not None and vm != vd:
        _vocab_differs(vm, vd)
    check_same_tokenizer(OP, model.tokenizer, draft.tokenizer)


def _vocab_differs(vm: int, vd: int) -> None:
    raise ValueError(
        f"{OP}: the draft's vocab_size ({vd}) differs from the target's ({vm}); the draft must "
        "use the target's tokenizer"
    )


def _caches(model: LanguageModel, rewind: int) -> list[Any]:
    """``model.make_cache()`` made rewindable by ``rewind`` tokens (the draft length): each
    :class:`~portable_llm.RotatingKVCache` (a :class:`~portable_llm.caches.hybrid.HybridCache`'s
    too) replaced by a :class:`~portable_llm.KVCache` (see the notes of
    :func:`speculative_generate`), and each :class:`~portable_llm.RecurrentCache` told to keep
    the states of the last ``rewind`` tokens (``max_rewind``: a recurrent state is restored,
    not re-run)."""
    caches = model.make_cache()
    kv = [attention_cache(c) for c in caches]
    static = any(isinstance(c, KVCache) and c.static_shapes for c in kv)
    out = []
    for c in caches:
        if isinstance(c, RotatingKVCache):
            c = KVCache(static_shapes=static)
        elif isinstance(c, HybridCache) and isinstance(c.attention, RotatingKVCache):
            c = HybridCache(KVCache(static_shapes=static), c.recurrent)
        state = recurrent_cache(c)
        if state is not None:
            state.max_rewind = max(state.max_rewind, rewind)
        out.append(c)
    return out


@dataclass
class _Speculation:
    """One run: the two models, the options, the draws' seeds and the statistics."""

    model: LanguageModel
    draft: LanguageModel
    k: int
    options: dict[str, Any]  # temperature, top_k, top_p, min_p
    keys: np.random.Generator  # seeds of the draws, in order
    chunk: int | None
    stats: SpeculativeStats
    V: int | None = None  # the target's vocab_size, else its first logits'

    @property
    def greedy(self) -> bool:
        return bool(self.options["temperature"] < GREEDY_BELOW)

    def _key(self) -> int:
        return int(self.keys.integers(0, 2**63))

    def _forward(self, model: LanguageModel, ids: list[int], cache: list[Any], last: bool) -> Array:
        x = np.asarray([ids], dtype=np.int64)  # (1, L)
        out = model(x, cache=cache, last_only=last)
        V = self.V
        if V is None and model is self.model:  # the target's first logits give V
            V = self.V = int(out.shape[-1]) if backend_of(out) is not None else None
        elif model is self.draft and V is not None and getattr(out, "shape", (V,))[-1] != V:
            _vocab_differs(V, int(out.shape[-1]))
        out = check_logits(OP, model, out, (1, None, V), "__call__")[0, ...]
        if not last and out.shape[0] != len(ids):  # (L | 1, V)
            raise ValueError(
                f"{OP}: the model returned logits for {out.shape[0]} positions of {len(ids)} "
                "with last_only=False (verifying needs every position's)"
            )
        return out

    def _prefill(self, model: LanguageModel, ids: list[int], cache: list[Any]) -> Array:
        """Logits ``(V,)`` of the prompt's last position (the prompt then in ``cache``)."""
        host = np.asarray([ids], dtype=np.int64)  # (1, L)
        start = prefill(model, host, cache, self.chunk)
        return self._forward(model, ids[start:], cache, True)[-1, ...]

    def _draw(self, model: LanguageModel, logits: Array) -> tuple[int, Array | None]:
        """A token of the filtered distribution of ``model``'s ``logits`` ``(V,)``, and its
        log-probs ``(V,)`` (``None`` when greedy)."""
        if self.greedy:
            return _host(model, greedy(logits[None, ...]))[0], None
        ids, lp = sample(logits[None, ...], key=self._key(), return_logprobs=True, **self.options)
        return _host(model, ids)[0], lp[0, ...]

    def tokens(self, ids: list[int], max_new: int, stops: frozenset[int]) -> Iterator[int]:
        """The new token ids, one at a time; fills ``stats`` as it goes."""
        stats = self.stats
        if max_new == 0:
            stats.finish_reason = "length"
            return
        start = time.perf_counter()
        target_cache = _caches(self.model, self.k)
        # The draft is lazy: its caches are made, and the prompt prefilled into them, at its
        # first proposal (never when the first token stops or is the last one asked for).
        draft_cache: list[Any] | None = None
        try:
            first, _ = self._draw(self.model, self._prefill(self.model, ids, target_cache))
            stats.prefill_seconds = time.perf_counter() - start
            done = 0
            # Tokens the draft has not seen (the prompt too, until it first runs); the last
            # one is also new to the target.
            pending = [*ids, first]
            round_tokens = [first]
            while True:
                for token in round_tokens:
                    if token in stops:
                        stats.stop_token = token
                        stats.finish_reason = "stop"
                        return
                    stats.generated_tokens += 1
                    done += 1
                    yield token
                    if done == max_new:
                        stats.finish_reason = "length"
                        return
                start = time.perf_counter()
                n = min(self.k, max_new - done - 1)  # a round yields up to n + 1 tokens
                if n and draft_cache is None:
                    draft_cache = _caches(self.draft, self.k)
                round_tokens, pending = self._round(
                    n, pending, stops, target_cache, draft_cache or []
                )
                stats.decode_seconds += time.perf_counter() - start
                stats.decode_steps += _counted(round_tokens, stops)
                stats.rounds += 1
        finally:  # both models' caches go back to them (ReleasingModel)
            release_cache(self.model, target_cache)
            release_cache(self.draft, draft_cache)

    def _propose(
        self, n: int, pending: list[int], stops: frozenset[int], draft_cache: list[Any]
    ) -> tuple[list[int], list[Array]]:
        """Up to ``n`` proposals of the draft after ``pending`` (the first call prefills the
        prompt in chunks): it stops after a stop token, which would end the output."""
        proposals: list[int] = []
        qs: list[Array] = []
        host = np.asarray([pending], dtype=np.int64)  # (1, L)
        feed = pending[prefill(self.draft, host, draft_cache, self.chunk) :] if n else []
        for _ in range(n):
            logits = self._forward(self.draft, feed, draft_cache, True)[-1, ...]  # (V,)
            token, q = self._draw(self.draft, logits)
            proposals.append(token)
            if q is not None:
                qs.append(q)
            if token in stops:  # nothing after it is ever yielded
                break
            feed = [token]
        return proposals, qs

    def _round(
        self,
        n: int,
        pending: list[int],
        stops: frozenset[int],
        target_cache: list[Any],
        draft_cache: list[Any],
    ) -> tuple[list[int], list[int]]:
        """Propose up to ``n`` tokens, verify them; return the round's tokens and the new
        pending."""
        proposals, qs = self._propose(n, pending, stops, draft_cache)
        m = len(proposals)
        logits = self._forward(self.model, [pending[-1], *proposals], target_cache, False)
        accepted, nxt = self._verify(logits, proposals, qs)  # logits (m + 1, V)
        self.stats.draft_tokens += m
        self.stats.accepted_tokens += accepted
        rewind_cache(self.model, target_cache, m - accepted)
        if m == 0:  # the draft did not run: what it has not seen grows (k = 0: it never runs)
            return [nxt], [*pending, nxt] if self.k else [nxt]
        if accepted == m:  # the draft never saw its last proposal
            return [*proposals, nxt], [proposals[-1], nxt]
        rewind_cache(self.draft, draft_cache, m - 1 - accepted)
        return [*proposals[:accepted], nxt], [nxt]

    def _verify(self, logits: Array, proposals: list[int], qs: list[Array]) -> tuple[int, int]:
        """How many proposals the target accepts, and its own next token.

        ``logits`` ``(n + 1, V)``: row ``i`` is the target's distribution of proposal ``i``
        (row ``n``: the token after all of them)."""
        n = len(proposals)
        if self.greedy:
            best = _host(self.model, greedy(logits))  # (n + 1,)
            accepted = next((i for i in range(n) if best[i] != proposals[i]), n)
            return accepted, best[accepted]
        bk: Backend | None = backend_of(logits)
        assert bk is not None
        xp = bk.xp
        p = logprobs(logits, **self.options)  # (n + 1, V), the filtered log-probs
        accepted = n
        if n:
            dev = bk.device_of(logits)
            q = xp.stack([asarray(x, backend=bk.name, device=dev) for x in qs])  # (n, V)
            q = xp.astype(q, p.dtype)
            d = asarray([[t] for t in proposals], backend=bk.name, device=dev)  # (n, 1)
            p_d = xp.exp(xp.take_along_axis(p[:n, ...], d, axis=-1))  # (n, 1)
            q_d = xp.exp(xp.take_along_axis(q, d, axis=-1))  # (n, 1)
            u = xp.astype(bk.uniform(bk.rng(self._key(), p), (n, 1), p), p.dtype)  # (n, 1)
            ok = bk.to_numpy(u * q_d < p_d).reshape(-1)  # accept with probability min(1, p/q)
            accepted = int(np.argmin(ok)) if not ok.all() else n
        if accepted < n:  # resample from norm(max(0, p - q))
            p_a = xp.exp(p[accepted, ...])  # (V,)
            residual = xp.maximum(p_a - xp.exp(q[accepted, ...]), xp.zeros_like(p_a))
            # p == q up to rounding leaves nothing: then p itself (p - q is 0 in exact math).
            residual = xp.where(xp.sum(residual) > 0, residual, p_a)
            positive = residual > 0
            ones, none = xp.ones_like(residual), xp.full_like(residual, -math.inf)
            row = xp.where(positive, xp.log(xp.where(positive, residual, ones)), none)
        else:  # all accepted: a bonus token from the target's last distribution
            row = p[n, ...]
        # sample at temperature 1 without filters draws from softmax(row) = exp(row) / sum.
        return accepted, _host(
            self.model, sample(row[None, ...], temperature=1.0, key=self._key())
        )[0]


def _host(model: LanguageModel, ids: Array) -> list[int]:
    """Token ids ``(B..)`` of ``model``'s backend as a list of ints on the host; ``-1`` (the
    mark of :func:`~portable_llm.greedy` and :func:`~portable_llm.sample` for logits with no
    distribution) is a ``ValueError``, as in :func:`~portable_llm.generate`."""
    out = [int(t) for t in to_numpy(ids).reshape(-1)]
    if min(out) < 0:
        raise ValueError(
            f"{OP}: the logits of {model!r} are NaN or all -inf; the weights or the dtype "
            "overflowed"
        )
    return out


def _counted(tokens: list[int], stops: frozenset[int]) -> int:
    """Tokens of a round that count as decoded: up to and including the first stop token."""
    for i, token in enumerate(tokens):
        if token in stops:
            return i + 1
    return len(tokens)
