"""The per-request penalties of generation, and their state over a batch of rows.

:class:`Penalties` holds one request's options, checked once (:meth:`Penalties.check`, shared
by :func:`~portable_llm.generate`, :class:`~portable_llm.BatchGenerator` and the server);
:class:`PenaltyRows` keeps, on the device, what :func:`~portable_llm.apply_penalties` needs for
the rows of a batched step: per-row penalties ``(B,)``, counts of the generated tokens
``(B, V)`` (updated each step with one one-hot add), the prompt mask, ``logit_bias`` and the
stop tokens that ``min_tokens`` bans. A step whose rows are the last step's reuses the arrays;
a row that joins is built once on the host and sent over, a row that leaves is dropped on the
device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from portable_llm.backends import Backend, backend_of
from portable_llm.core.checks import check_int, check_real
from portable_llm.core.types import Array
from portable_llm.ops.penalties import (
    FREQUENCY_PENALTY_RANGE,
    PRESENCE_PENALTY_RANGE,
    apply_penalties,
    logit_bias_items,
)

__all__ = ["Penalties", "PenaltyProcessor", "PenaltyRows", "Row"]


@dataclass(frozen=True)
class Penalties:
    """One request's penalties (OpenAI's and vLLM's sampling fields), checked.

    Attributes
    ----------
    frequency_penalty : float in ``[-2, 2]``
    presence_penalty : float in ``[-2, 2]``
    repetition_penalty : float, > 0
        Over every token of the prompt and of the output (transformers', vLLM's); ``1``: none.
    logit_bias : tuple of ``(token_id, bias)``, biases in ``[-100, 100]``
    min_tokens : int, >= 0
        The stop tokens are banned (``-inf``) until this many tokens were generated.
    """

    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    @property
    def neutral(self) -> bool:
        """Whether these change no logit (every row of the batch may then skip the pass)."""
        return self == _NEUTRAL

    @classmethod
    def check(
        cls,
        op: str,
        *,
        vocab_size: int | None,
        max_new_tokens: int | None = None,
        frequency_penalty: Any = 0.0,
        presence_penalty: Any = 0.0,
        repetition_penalty: Any = 1.0,
        logit_bias: Mapping[Any, Any] | None = None,
        min_tokens: Any = 0,
    ) -> Penalties:
        """The options checked (``TypeError``/``ValueError`` naming the first bad one):
        penalties in their ranges, ``logit_bias`` keys token ids in ``[0, vocab_size)``
        (``>= 0`` for ``None``: the logits' ``V`` bounds them when the rows are built),
        ``min_tokens <= max_new_tokens``."""
        lo, hi = FREQUENCY_PENALTY_RANGE
        frequency = check_real(op, "frequency_penalty", frequency_penalty, low=lo, high=hi)
        lo, hi = PRESENCE_PENALTY_RANGE
        presence = check_real(op, "presence_penalty", presence_penalty, low=lo, high=hi)
        repetition = 1.0
        if repetition_penalty is not None:
            repetition = check_real(op, "repetition_penalty", repetition_penalty, low=0,
                                    low_open=True)  # fmt: skip
        bias: tuple[tuple[int, float], ...] = ()
        if logit_bias is not None:
            pairs = dict(logit_bias_items(logit_bias, vocab_size=vocab_size, op=op))
            bias = tuple((i, float(np.float32(pairs[i]))) for i in sorted(pairs) if pairs[i])
        least = check_int(op, "min_tokens", min_tokens, low=0, high=max_new_tokens)
        return cls(frequency, presence, repetition, bias, least)


_NEUTRAL = Penalties()


@dataclass
class Row:
    """One row of a batched step, as :class:`PenaltyRows` reads it.

    ``key`` names the row from step to step (a request id); ``out`` is the tokens it generated
    so far (read when the row joins), ``stops`` the tokens ``min_tokens`` bans.
    """

    key: int
    penalties: Penalties
    prompt: Sequence[int]
    out: Sequence[int]
    stops: frozenset[int]


class PenaltyRows:
    """The penalties of a batch's rows, kept on the device from step to step.

    Call :meth:`apply` with the step's logits and rows, then :meth:`advance` with the tokens
    they got. Rows whose penalties are all neutral change nothing, bit for bit; a step where
    every row's are neutral costs nothing (no pass over the logits).

    Parameters
    ----------
    vocab_size : int
    """

    def __init__(self, vocab_size: int) -> None:
        self.V = check_int("PenaltyRows", "vocab_size", vocab_size, low=1)
        self._keys: list[int] = []
        self._state: dict[str, Any] = {}  # name -> (B, ...) arrays, rows in _keys' order
        self._bk: Backend | None = None

    def apply(self, logits: Array, rows: Sequence[Row], /) -> Array:
        """``logits`` ``(B, V)`` after each row's penalties (``rows[b]`` is row ``b``);
        ``logits`` itself when every row's are neutral."""
        if all(r.penalties.neutral for r in rows):
            self._keys, self._state = [], {}
            return logits
        bk = backend_of(logits)
        assert bk is not None, "PenaltyRows.apply: logits must be an array"
        self._align(bk, bk.device_of(logits), rows)
        s, p = self._state, [r.penalties for r in rows]
        # Only the passes some row needs (read on the host: the rows' options and lengths).
        repetition = any(x.repetition_penalty != 1 for x in p)
        banned = None
        if any(len(r.out) < r.penalties.min_tokens for r in rows):
            banned = s["stop_mask"] & (s["generated"] < s["min_tokens"])[:, None]  # (B, V)
        return apply_penalties(
            logits, s["counts"], prompt_mask=s["prompt_mask"] if repetition else None,
            frequency_penalty=s["frequency"] if any(x.frequency_penalty for x in p) else 0.0,
            presence_penalty=s["presence"] if any(x.presence_penalty for x in p) else 0.0,
            repetition_penalty=s["repetition"] if repetition else 1.0,
            logit_bias=s["bias"] if any(x.logit_bias for x in p) else None, banned=banned,
        )  # fmt: skip

    def advance(self, tokens: Sequence[int], /) -> None:
        """Count the tokens the rows of the last :meth:`apply` got (one per row, in order)."""
        if not self._keys:
            return
        bk = self._bk
        assert bk is not None
        xp, s = bk.xp, self._state
        ids = bk.from_numpy(np.asarray(tokens, np.int32), bk.device_of(s["counts"]))  # (B,)
        hit = s["iota"][None, :] == ids[:, None]  # (B, V)
        s["counts"] = s["counts"] + xp.astype(hit, s["counts"].dtype)
        s["generated"] = s["generated"] + 1

    def _align(self, bk: Backend, device: Any, rows: Sequence[Row]) -> None:
        """Make the state's rows ``rows``, in order: rows kept from the last step are taken
        on the device, new ones built on the host."""
        keys = [r.key for r in rows]
        if keys == self._keys and bk is self._bk:
            return
        old = {k: i for i, k in enumerate(self._keys)} if bk is self._bk else {}
        kept = [k for k in keys if k in old]
        fresh = [r for r in rows if r.key not in old]
        xp, parts = bk.xp, {}
        if fresh:
            parts = {name: [bk.from_numpy(a, device)] for name, a in self._host(fresh).items()}
        if kept:
            index = bk.from_numpy(np.asarray([old[k] for k in kept], np.int32), device)
            for name, arr in self._state.items():
                if name != "iota":
                    parts.setdefault(name, []).insert(0, xp.take(arr, index, axis=0))
        stacked = kept + [r.key for r in fresh]  # the rows' order in the joined arrays
        order = {k: i for i, k in enumerate(stacked)}
        perm = bk.from_numpy(np.asarray([order[k] for k in keys], np.int32), device)
        state = {}
        for name, arrays in parts.items():
            joined = arrays[0] if len(arrays) == 1 else xp.concat(arrays, axis=0)
            state[name] = joined if stacked == keys else xp.take(joined, perm, axis=0)
        state["iota"] = bk.from_numpy(np.arange(self.V, dtype=np.int32), device)  # (V,)
        self._keys, self._state, self._bk = keys, state, bk

    def _host(self, rows: Sequence[Row]) -> dict[str, np.ndarray]:
        """The state of ``rows`` built on the host (each ``(n, V)`` or ``(n,)``)."""
        n, V = len(rows), self.V
        counts = np.zeros((n, V), np.float32)  # exact up to 2**24 per token
        prompt = np.zeros((n, V), bool)
        bias = np.zeros((n, V), np.float32)
        stops = np.zeros((n, V), bool)
        for b, r in enumerate(rows):
            np.add.at(counts[b], np.asarray(r.out, np.int64), 1)
            prompt[b, np.asarray(r.prompt, np.int64)] = True
            for token, value in r.penalties.logit_bias:
                if token >= V:  # a model without vocab_size: checked against its logits here
                    raise ValueError(
                        f"logit_bias: token id {token} is outside [0, {V}) (the logits' vocabulary)"
                    )
                bias[b, token] = value
            stop = [t for t in r.stops if 0 <= t < V]
            stops[b, stop] = True
        p = [r.penalties for r in rows]
        return {
            "counts": counts,
            "prompt_mask": prompt,
            "bias": bias,
            "stop_mask": stops,
            "generated": np.asarray([len(r.out) for r in rows], np.int32),
            "min_tokens": np.asarray([x.min_tokens for x in p], np.int32),
            "frequency": np.asarray([x.frequency_penalty for x in p], np.float32),
            "presence": np.asarray([x.presence_penalty for x in p], np.float32),
            "repetition": np.asarray([x.repetition_penalty for x in p], np.float32),
        }


class PenaltyProcessor:
    """A logits processor (:data:`~portable_llm.generation.sampler.LogitsProcessor`) that
    applies :class:`Penalties` to every row, its state kept by a :class:`PenaltyRows`.

    The first call takes ``tokens`` as the rows' prompts; each later call whose rows each grew
    by one token counts that token as generated. Any other call (new rows, another batch size)
    starts over: ``tokens`` are then the prompts of a new generation.

    Parameters
    ----------
    penalties : Penalties
    stops : iterable of int
        The tokens ``penalties.min_tokens`` bans.
    """

    def __init__(self, penalties: Penalties, stops: Any = ()) -> None:
        self.penalties = penalties
        self.stops = frozenset(int(t) for t in stops)
        self._rows: PenaltyRows | None = None
        self._prompts: list[list[int]] = []
        self._outs: list[list[int]] = []

    def __call__(self, tokens: Sequence[Sequence[int]], logits: Array) -> Array:
        V = int(logits.shape[-1])
        grew = (
            self._rows is not None
            and self._rows.V == V
            and len(tokens) == len(self._prompts)
            and all(
                len(t) == len(p) + len(o) + 1
                for t, p, o in zip(tokens, self._prompts, self._outs, strict=True)
            )
        )
        if grew:
            new = [int(t[-1]) for t in tokens]
            assert self._rows is not None
            self._rows.advance(new)
            for out, token in zip(self._outs, new, strict=True):
                out.append(token)
        else:
            biased = [t for t, _ in self.penalties.logit_bias if t >= V]
            if biased:
                raise ValueError(
                    f"logit_bias: token id {biased[0]} is outside [0, {V}) (the logits' vocabulary)"
                )
            self._rows = PenaltyRows(V)
            self._prompts = [list(t) for t in tokens]
            self._outs = [[] for _ in tokens]
        rows = [
            Row(b, self.penalties, p, o, self.stops)
            for b, (p, o) in enumerate(zip(self._prompts, self._outs, strict=True))
        ]
        assert self._rows is not None
        return self._rows.apply(logits, rows)
