"""Choosing the next token: greedy, temperature, top-k, top-p (nucleus) and min-p sampling.

The filters keep a prefix of the tokens sorted by descending logit (ties: lower id first), so
every step runs on the sorted logits: top-k keeps the first k, top-p the shortest prefix whose
probability reaches p, min-p the tokens with ``p >= min_p * p_max``; each renormalises what it
keeps. A token is then drawn by inverting the CDF of what remains at one uniform draw per row.

The Array API has no random numbers: the uniform draws come from the backend's own generator
(:meth:`~portable_llm.backends.Backend.rng` and ``uniform``); everything else is pure ``xp``.
"""

from __future__ import annotations

import math
from typing import Any

from portable_llm.backends import Backend, resolve
from portable_llm.core.checks import (
    check_float,
    check_ndim,
    check_optional_int,
    check_real,
    float_compute_dtype,
)
from portable_llm.core.dispatch import pick, portable
from portable_llm.core.types import Array, Namespace

__all__ = ["greedy", "log_softmax", "logprobs", "sample"]

#: A temperature below this is greedy, as 0 is (vLLM's ``_SAMPLING_EPS``). Logits this close to
#: the top one would otherwise be a coin flip decided by float32 rounding, and ``x / T``
#: overflows float32 for a subnormal ``T``.
GREEDY_BELOW = 1e-5


def _check(
    op: str,
    bk: Backend,
    logits: Array,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    min_p: Any,
) -> tuple[float, int | None, float | None, float | None]:
    """Check the options; ``(temperature, top_k, top_p, min_p)`` as Python numbers."""
    check_float(op, "logits", logits, bk)
    check_ndim(op, "logits", logits, 1, "B.. x V")
    vocab = logits.shape[-1]
    if vocab < 1:
        raise ValueError(f"{op}: logits must have a vocabulary of at least one token, got {vocab}")
    temperature = check_real(op, "temperature", temperature, low=0.0)
    top_k = check_optional_int(op, "top_k", top_k)
    if top_k is not None and not 1 <= top_k <= vocab:
        raise ValueError(
            f"{op}: top_k must be in [1, V] = [1, {vocab}] (logits shape "
            f"{tuple(logits.shape)}), got {top_k}"
        )
    reals: list[float | None] = []
    for name, value, low_open in (("top_p", top_p, True), ("min_p", min_p, False)):
        if value is not None:
            value = check_real(op, name, value, finite=False)
            if not ((0 < value <= 1) if low_open else (0 <= value <= 1)):
                interval = "(0, 1]" if low_open else "[0, 1]"
                raise ValueError(f"{op}: {name} must be in {interval}, got {value!r}")
        reals.append(value)
    return temperature, top_k, reals[0], reals[1]


def _filtered(
    xp: Namespace, logits: Array, temperature: float, top_k: int | None, top_p: float | None,
    min_p: float | None,
) -> tuple[Array, Array]:  # fmt: skip
    """``(order, logp)``: token ids by descending logit, and the filtered log-probs in that order.

    Both ``(B.., V)``; ``logp`` in float32 (float64 for float64 logits), ``-inf`` where removed.
    A row with no distribution (a NaN logit, or every logit ``-inf``) is NaN throughout.
    """
    x = xp.astype(logits, float_compute_dtype(xp, logits.dtype))
    order = xp.argsort(x, axis=-1, descending=True, stable=True)  # (B.., V)
    xs = xp.take_along_axis(x, order, axis=-1)  # (B.., V), descending
    top = xs[..., :1]  # (B.., 1), the row maximum
    # Scaled relative to the maximum: z <= 0, so nothing overflows to +inf. A +inf maximum: the
    # +inf tokens share the mass and the rest get none (softmax's limit, never inf - inf). No
    # maximum (a NaN, or every logit -inf): NaN, so the row has no distribution.
    finite = (top > -math.inf) & (top < math.inf)
    neg_inf = xp.full_like(xs, -math.inf)
    z = (xs - xp.where(finite, top, xp.zeros_like(top))) / temperature  # (B.., V)
    at_inf = xp.where(xs == top, xp.zeros_like(xs), neg_inf)
    logp = xp.where(finite, z, xp.where(top == math.inf, at_inf, xp.full_like(xs, math.nan)))
    if top_k is not None:
        logp = xp.where(_ranks(xp, logp) < top_k, logp, neg_inf)
    logp = _log_softmax(xp, logp)
    if top_p is not None and top_p < 1:
        p = xp.exp(logp)
        before = xp.cumulative_sum(p, axis=-1) - p  # probability of the tokens ranked higher
        # The first token always stays: before == 0 < top_p.
        logp = _log_softmax(xp, xp.where(before < top_p, logp, neg_inf))
    if min_p is not None and min_p > 0:
        p = xp.exp(logp)
        # p[..., 0] is the largest; removed tokens have p == 0 < min_p * p_max.
        logp = _log_softmax(xp, xp.where(p >= min_p * p[..., :1], logp, neg_inf))
    return order, logp


def _log_softmax(xp: Namespace, zs: Array) -> Array:
    # zs is sorted descending, so its first entry is the row maximum (0: rank 0 is kept).
    shifted = zs - zs[..., :1]
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=-1, keepdims=True))


def _unsort(xp: Namespace, order: Array, sorted_values: Array) -> Array:
    inverse = xp.argsort(order, axis=-1)  # position of each token id in the sorted order
    return xp.take_along_axis(sorted_values, inverse, axis=-1)


def _ranks(xp: Namespace, like: Array) -> Array:
    """0, 1, ..., V-1 along the last axis, in like's float dtype, shape and device (exact for
    V < 2**24: float32 integers)."""
    return xp.cumulative_sum(xp.ones_like(like), axis=-1) - 1


def _one_hot_logprobs(xp: Namespace, ids: Array, logits: Array) -> Array:
    zero = xp.zeros_like(logits, dtype=float_compute_dtype(xp, logits.dtype))  # (B.., V)
    hit = _ranks(xp, zero) == xp.astype(ids, zero.dtype)[..., None]
    out = xp.where(hit, zero, xp.full_like(zero, -math.inf))
    return xp.where(ids[..., None] < 0, xp.full_like(zero, math.nan), out)  # id -1: NaN row


def _index_dtype(xp: Namespace) -> Any:
    """The backend's default integer dtype (int64; int32 on MLX and on JAX without x64)."""
    return xp.asarray(0).dtype


@portable("log_softmax", pure=True)
def log_softmax(xp: Namespace, logits: Array) -> Array:
    """``log_softmax`` of ``logits`` ``(B.., V)`` over the last axis: ``x - max - log sum exp``,
    in float32 (float64 kept); a row without a finite maximum is shifted by 0 (its NaN or
    infinities come through). The log-probabilities a decode loop yields beside each token
    (the unfiltered distribution at temperature 1); its portable implementation, run through
    the dispatcher (``pick(bk, "log_softmax", "auto", logits)``) so a trace records it."""
    x = logits if logits.dtype == xp.float64 else xp.astype(logits, xp.float32)
    top = xp.max(x, axis=-1, keepdims=True)  # (B.., 1)
    top = xp.where((top > -math.inf) & (top < math.inf), top, xp.zeros_like(top))
    shifted = x - top
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=-1, keepdims=True))


@portable("greedy", pure=True)
def _greedy(xp: Namespace, logits: Array) -> Array:
    ids = xp.astype(xp.argmax(logits, axis=-1), _index_dtype(xp))  # (B..)
    # No token when the row has a NaN or is all -inf: id -1, marked on the device (no sync).
    some = xp.any(logits > -math.inf, axis=-1) & ~xp.any(xp.isnan(logits), axis=-1)  # (B..)
    return xp.where(some, ids, xp.full_like(ids, -1))


# Not pure=True (compiled on JAX): the float options would be static, one compilation per value.
@portable("logprobs")
def _logprobs(
    xp: Namespace, logits: Array, *, temperature: float, top_k: int | None, top_p: float | None,
    min_p: float | None,
) -> Array:  # fmt: skip
    if temperature < GREEDY_BELOW:
        return _one_hot_logprobs(xp, _greedy(xp, logits), logits)
    order, logp = _filtered(xp, logits, temperature, top_k, top_p, min_p)
    return _unsort(xp, order, logp)


@portable("sample")
def _sample(
    xp: Namespace, logits: Array, u: Array, *, temperature: float, top_k: int | None,
    top_p: float | None, min_p: float | None, return_logprobs: bool,
) -> Any:  # fmt: skip
    """Inverse-CDF draw at the uniforms ``u`` ``(B.., 1)``; ``(ids, logprobs)`` if asked."""
    if temperature < GREEDY_BELOW:
        ids = _greedy(xp, logits)
        return (ids, _one_hot_logprobs(xp, ids, logits)) if return_logprobs else ids
    order, logp = _filtered(xp, logits, temperature, top_k, top_p, min_p)
    p = xp.exp(logp)  # (B.., V), sorted descending; removed tokens are 0
    cdf = xp.cumulative_sum(p, axis=-1)
    t = xp.astype(u, p.dtype) * cdf[..., -1:]
    idx = order.dtype
    j = xp.sum(xp.astype(cdf <= t, idx), axis=-1, keepdims=True)  # (B.., 1): first cdf > t
    # Guard against rounding: never past the last token of positive probability (and never
    # before the first: a NaN row has none).
    last = xp.sum(xp.astype(p > 0, idx), axis=-1, keepdims=True) - 1
    j = xp.maximum(xp.minimum(j, last), xp.zeros_like(j))
    ids = xp.astype(xp.take_along_axis(order, j, axis=-1)[..., 0], _index_dtype(xp))  # (B..)
    ids = xp.where(xp.isnan(logp[..., 0]), xp.full_like(ids, -1), ids)  # no distribution: -1
    return (ids, _unsort(xp, order, logp)) if return_logprobs else ids


def greedy(logits: Array, /, *, backend: str | None = None) -> Array:
    """The most likely token of each row: ``argmax(logits, axis=-1)`` (ties: the lowest id).

    Parameters
    ----------
    logits : array, shape ``(B.., V)``, float dtype
    backend : str, optional

    Returns
    -------
    array, shape ``(B..)``, the backend's default integer dtype
        int64; int32 on MLX and on JAX without ``jax_enable_x64``. ``-1`` for a row with a NaN
        logit or with every logit ``-inf`` (marked on the device: no host sync).
    """
    bk, (logits,) = resolve("greedy", backend, logits)
    _check("greedy", bk, logits, 1.0, None, None, None)
    return pick(bk, "greedy", "auto", logits)(bk.xp, logits)


def logprobs(
    logits: Array,
    /,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    backend: str | None = None,
) -> Array:
    """Log-probabilities of the distribution :func:`sample` draws from, for every token.

    ``log_softmax(logits / temperature)`` after the filters (top-k, then top-p, then min-p, each
    renormalising); removed tokens get ``-inf``. With no filters and ``temperature=1`` this is
    the model's own ``log_softmax(logits)``; with ``temperature=0`` (or below ``1e-5``) the
    distribution is the point mass on :func:`greedy`'s token (0 there, ``-inf`` elsewhere; NaN
    throughout where greedy gives ``-1``).

    Parameters
    ----------
    logits : array, shape ``(B.., V)``, float dtype
    temperature, top_k, top_p, min_p
        As for :func:`sample`.
    backend : str, optional

    Returns
    -------
    array, shape ``(B.., V)``, float32 (float64 for float64 logits)
    """
    bk, (logits,) = resolve("logprobs", backend, logits)
    temperature, top_k, top_p, min_p = _check(
        "logprobs", bk, logits, temperature, top_k, top_p, min_p
    )
    opts = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    return pick(bk, "logprobs", "auto", logits, **opts)(bk.xp, logits, **opts)


def sample(
    logits: Array,
    /,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    key: Any = None,
    return_logprobs: bool = False,
    backend: str | None = None,
) -> Any:
    """Draw one token per row from ``softmax(logits / temperature)``, filtered.

    The filters apply in this order, each to the distribution the previous one left (and
    renormalised), ranking tokens by logit with ties broken by the lower id:

    1. ``top_k``: keep the k most likely tokens;
    2. ``top_p`` (nucleus): keep the shortest prefix of the ranking whose probability reaches
       ``top_p`` -- a token stays when the tokens ranked above it hold less than ``top_p``, so
       the most likely token always stays;
    3. ``min_p``: keep the tokens with ``p >= min_p * p_max``.

    The draw inverts the CDF of what remains at one float32 uniform per row; the probabilities
    are computed in float32 (float64 for float64 logits).

    Parameters
    ----------
    logits : array, shape ``(B.., V)``, float dtype
    temperature : float, >= 0
        ``0``, or anything below :data:`GREEDY_BELOW` (``1e-5``), means :func:`greedy` (the
        filters and ``key`` are then unused).
    top_k : int in ``[1, V]``, optional
    top_p : float in ``(0, 1]``, optional
    min_p : float in ``[0, 1]``, optional
    key : int, or the backend's generator or key, optional
        Where the uniform draws come from. An int seed in ``[0, 2**63)``: a fresh generator
        seeded with it, so the same seed gives the same tokens on that backend (not across
        backends: each uses its own generator). Or the library's own: a
        ``numpy.random.Generator`` (NumPy, array-api-strict), a ``torch.Generator``, an
        ``mx.random.key``, a ``jax.random.key`` -- generators are advanced by the draw, keys are
        used as given (split them yourself). ``None``: the library's global state (a fresh
        entropy-seeded NumPy generator; torch's and MLX's default generators, which
        ``torch.manual_seed``/``mx.random.seed`` control); JAX has none, so it needs a key.
    return_logprobs : bool
        Also return :func:`logprobs` of the distribution drawn from.
    backend : str, optional

    Returns
    -------
    ids : array, shape ``(B..)``, the backend's default integer dtype
    logprobs : array, shape ``(B.., V)``, float32 (float64 for float64 logits)
        Only with ``return_logprobs=True``.

    Notes
    -----
    No step reads values back to the host, so ``sample`` traces under ``jax.jit`` (with the
    options static and the key an argument). For the same reason bad logits are not an error:
    ``+inf`` logits share the mass equally (softmax's limit); a row with a NaN logit, or with
    every logit ``-inf``, has no distribution and gives id ``-1`` and NaN log-probs, which
    :func:`~portable_llm.ops.embedding` rejects at the next step.
    """
    bk, (logits,) = resolve("sample", backend, logits)
    temperature, top_k, top_p, min_p = _check(
        "sample", bk, logits, temperature, top_k, top_p, min_p
    )
    if temperature < GREEDY_BELOW:
        u = None
    else:
        try:
            rng = bk.rng(key, logits)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"sample: {exc}") from None
        u = bk.uniform(rng, (*logits.shape[:-1], 1), logits)  # (B.., 1) float32 in [0, 1)
    opts = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
            "return_logprobs": bool(return_logprobs)}  # fmt: skip
    return pick(bk, "sample", "auto", logits, u, **opts)(bk.xp, logits, u, **opts)
