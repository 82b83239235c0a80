"""The grammar's token mask on the logits: one :class:`Constraint` per sequence, the rows of a
step masked in one ``where`` (:func:`mask_logits`), and :func:`constrained_logits`, the logits
processor :func:`~portable_llm.generate` adds for ``response_format``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from portable_llm.backends import backend_of
from portable_llm.core.types import Array
from portable_llm.generation.grammar.spec import Matcher

__all__ = ["Constraint", "constrained_logits", "mask_logits"]


class Constraint:
    """One sequence kept inside a grammar: :meth:`allowed` takes the sequence's ids so far,
    whose generated ones begin at ``start`` (the matcher accepts those it has not seen), and
    gives the mask of the next."""

    def __init__(self, matcher: Matcher) -> None:
        self.matcher = matcher
        self.seen = 0  # generated ids the matcher accepted

    def allowed(self, ids: Sequence[int], /, *, start: int = 0) -> np.ndarray:
        for i in range(start + self.seen, len(ids)):
            self.matcher.accept(int(ids[i]))
        self.seen = len(ids) - start
        return self.matcher.allowed()


def mask_logits(logits: Array, masks: Sequence[np.ndarray | None], /) -> Array:
    """``logits`` ``(B, V)`` with ``-inf`` where row ``b``'s mask ``(V,)`` is ``False`` (a
    ``None`` mask keeps the row); on the logits' backend and device."""
    bk = backend_of(logits)
    assert bk is not None, "mask_logits: logits must be an array"
    B, V = logits.shape  # (B, V)
    if len(masks) != B:
        raise ValueError(f"mask_logits: {len(masks)} masks for logits of shape {(B, V)}")
    keep = np.ones((B, V), dtype=bool)
    for b, mask in enumerate(masks):
        if mask is not None:
            n = min(V, mask.shape[0])
            keep[b, :n] = mask[:n]
            keep[b, n:] = False
    allowed = bk.from_numpy(keep, bk.device_of(logits))  # (B, V)
    return bk.xp.where(allowed, logits, bk.xp.asarray(-bk.xp.inf, dtype=logits.dtype))


def constrained_logits(matchers: Sequence[Matcher], /) -> Callable[[Any, Array], Array]:
    """A logits processor (:data:`~portable_llm.generation.sampler.LogitsProcessor`) that keeps
    row ``b`` inside ``matchers[b]``'s grammar: the first call takes ``tokens[b]`` as the
    prompt; each call accepts the ids row ``b`` gained since, then masks the logits
    (:func:`mask_logits`)."""
    rows = [Constraint(m) for m in matchers]
    prompts: list[int] = []

    def processor(tokens: Any, logits: Array) -> Array:
        if not prompts:
            prompts.extend(len(row) for row in tokens)
        if len(tokens) != len(rows):
            raise ValueError(f"constrained_logits: {len(rows)} matchers for {len(tokens)} rows")
        masks = [c.allowed(row, start=p) for c, row, p in zip(rows, tokens, prompts, strict=True)]
        return mask_logits(logits, masks)

    return processor
