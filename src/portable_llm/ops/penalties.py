"""Penalties and biases on the logits, per row of a batch: ``logit_bias``, banned tokens, the
repetition penalty (CTRL's, as transformers and vLLM apply it) and OpenAI's frequency and
presence penalties.

One call handles every row of a batched step: each row has its own penalties (a ``(B..)``
array, or one number for all rows), its own counts of the tokens it generated and its own
prompt mask, so a batch whose requests ask for different penalties runs one pass of array ops.
In order, with ``x`` the logits (float32; float64 kept):

1. ``x + logit_bias``, then ``-inf`` where ``banned`` (``min_tokens``: a stop token before the
   request's minimum length);
2. the repetition penalty ``r`` on each token seen (in the prompt or generated):
   ``x / r`` where ``x > 0``, else ``x * r`` (transformers' ``RepetitionPenaltyLogitsProcessor``,
   vLLM's ``repetition_penalty``);
3. ``x - frequency_penalty * count - presence_penalty * (count > 0)`` over the generated tokens
   only (OpenAI's definition; vLLM's).

This is vLLM's order (its logits processors, then ``apply_penalties``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from portable_llm.backends import Backend, backend_of, resolve
from portable_llm.core.checks import (
    check_float,
    check_int,
    check_ndim,
    check_real,
    float_compute_dtype,
)
from portable_llm.core.dispatch import pick, portable
from portable_llm.core.types import Array, Namespace

__all__ = [
    "FREQUENCY_PENALTY_RANGE",
    "LOGIT_BIAS_RANGE",
    "PRESENCE_PENALTY_RANGE",
    "apply_penalties",
    "logit_bias_items",
    "logit_bias_row",
]

#: The interval OpenAI (and vLLM) accept for ``frequency_penalty``.
FREQUENCY_PENALTY_RANGE = (-2.0, 2.0)
#: The interval OpenAI (and vLLM) accept for ``presence_penalty``.
PRESENCE_PENALTY_RANGE = (-2.0, 2.0)
#: The interval OpenAI accepts for each ``logit_bias`` value.
LOGIT_BIAS_RANGE = (-100.0, 100.0)

_ROW_OPTIONS = ("frequency_penalty", "presence_penalty", "repetition_penalty")


@portable("apply_penalties")
def _apply_penalties(
    xp: Namespace, logits: Array, counts: Array, prompt_mask: Array | None, frequency: Any,
    presence: Any, repetition: Any, bias: Array | None, banned: Array | None,
) -> Array:  # fmt: skip
    """The penalties (module docstring); per-row values are arrays ``(B.., 1)`` or floats."""
    x = xp.astype(logits, float_compute_dtype(xp, logits.dtype), copy=False)  # (B.., V)
    if bias is not None:
        x = x + xp.astype(bias, x.dtype, copy=False)
    if banned is not None:
        x = xp.where(banned, xp.full_like(x, -math.inf), x)
    c = xp.astype(counts, x.dtype, copy=False)  # (B.., V)
    generated = c > 0
    if repetition is not None:
        seen = generated if prompt_mask is None else (generated | prompt_mask)
        penalised = xp.where(x > 0, x / repetition, x * repetition)
        x = xp.where(seen, penalised, x)
    if frequency is not None:
        x = x - frequency * c
    if presence is not None:
        x = x - presence * xp.astype(generated, x.dtype)
    return x


def _row_option(
    op: str, name: str, value: Any, neutral: float, bk: Backend, rows: tuple[int, ...], like: Array
) -> Any:
    """A per-row option as a float, an array ``(B.., 1)`` in ``like``'s dtype, or ``None``
    where it changes nothing (the number ``neutral``)."""
    if isinstance(value, numbers.Real):
        low, high = {
            "frequency_penalty": FREQUENCY_PENALTY_RANGE,
            "presence_penalty": PRESENCE_PENALTY_RANGE,
        }.get(name, (0.0, None))
        v = check_real(op, name, value, low=low, high=high, low_open=high is None)
        return None if v == neutral else v
    if backend_of(value) is not bk:
        raise TypeError(
            f"{op}: {name} must be a real number or a {bk.name} array of shape {rows}, got "
            f"{type(value).__name__}"
        )
    check_float(op, name, value, bk)
    if tuple(value.shape) != rows:
        raise ValueError(
            f"{op}: {name} must have shape B.. = {rows} (one value per row of logits of shape "
            f"{(*rows, like.shape[-1])}), got {tuple(value.shape)}"
        )
    return bk.xp.astype(value, float_compute_dtype(bk.xp, like.dtype))[..., None]  # (B.., 1)


def apply_penalties(
    logits: Array,
    counts: Array,
    /,
    *,
    prompt_mask: Array | None = None,
    frequency_penalty: float | Array = 0.0,
    presence_penalty: float | Array = 0.0,
    repetition_penalty: float | Array = 1.0,
    logit_bias: Array | None = None,
    banned: Array | None = None,
    backend: str | None = None,
) -> Array:
    """The logits after ``logit_bias``, ``banned`` and the penalties, every row at once.

    See the module docstring for the formulas and their order. Each penalty is one number for
    every row, or an array ``(B..)`` holding each row's (a batch of requests that ask for
    different penalties); at their neutral values (0, 0, 1) a row is unchanged, bit for bit
    (in float32; float64 kept).

    Parameters
    ----------
    logits : array, shape ``(B.., V)``, float dtype
    counts : array, shape ``(B.., V)``, integer or float dtype
        How many times each row generated each token (the prompt not included).
    prompt_mask : array, shape ``(B.., V)``, bool, optional
        The tokens of each row's prompt: seen, for the repetition penalty.
    frequency_penalty : float in ``[-2, 2]``, or array ``(B..)``
        Subtracted once per time the token was generated.
    presence_penalty : float in ``[-2, 2]``, or array ``(B..)``
        Subtracted once if the token was generated at all.
    repetition_penalty : float, > 0, or array ``(B..)``
        Divides the positive logits of the tokens seen (prompt or generated) and multiplies
        the negative ones; ``1``: none.
    logit_bias : array, shape ``(B.., V)`` or ``(V,)``, float, optional
        Added to the logits first (OpenAI's ``logit_bias``, made dense: :func:`logit_bias_row`).
    banned : array, shape ``(B.., V)`` or ``(V,)``, bool, optional
        Tokens that get ``-inf`` (a stop token before ``min_tokens``).
    backend : str, optional

    Returns
    -------
    array, shape ``(B.., V)``, float32 (float64 for float64 logits)

    Notes
    -----
    The values inside per-row arrays are not read back (no host sync), so their ranges are the
    caller's to check (:class:`~portable_llm.generation.penalties.Penalties` does).
    """
    op = "apply_penalties"
    options = [frequency_penalty, presence_penalty, repetition_penalty]
    for name, value in zip(_ROW_OPTIONS, options, strict=True):
        if isinstance(value, list | tuple | str | None):
            raise TypeError(
                f"{op}: {name} must be a real number or an array of one value per row, got "
                f"{type(value).__name__}"
            )
    options = [float(v) if isinstance(v, np.integer | np.floating) else v for v in options]
    bk, (logits, counts, prompt_mask, logit_bias, banned, *options) = resolve(
        op, backend, logits, counts, prompt_mask, logit_bias, banned, *options
    )
    check_float(op, "logits", logits, bk)
    check_ndim(op, "logits", logits, 1, "B.. x V")
    arrays = {"counts": counts, "prompt_mask": prompt_mask, "logit_bias": logit_bias,
              "banned": banned}  # fmt: skip
    _check_arrays(op, bk, tuple(logits.shape), arrays)
    rows, xp = tuple(logits.shape[:-1]), bk.xp
    per_row = [
        _row_option(op, name, value, neutral, bk, rows, logits)
        for name, value, neutral in zip(_ROW_OPTIONS, options, (0, 0, 1), strict=True)
    ]
    args = (logits, counts, prompt_mask, *per_row, logit_bias, banned)
    return pick(bk, op, "auto", *args)(xp, *args)


_KIND_NAMES = {"iuf": "integer or float", "b": "bool", "f": "float"}
#: Each array argument: its dtype kinds, and whether one row ``(V,)`` for every row is taken.
_ARRAYS = {"counts": ("iuf", False), "prompt_mask": ("b", False), "logit_bias": ("f", True),
           "banned": ("b", True)}  # fmt: skip


def _check_arrays(op: str, bk: Backend, shape: tuple[int, ...], arrays: dict[str, Any]) -> None:
    """Each array of :func:`apply_penalties` (``None`` skipped): the logits' ``shape`` (or
    ``(V,)`` where one row serves all), a dtype of its kind."""
    V = shape[-1]
    for name, arr in arrays.items():
        if arr is None:
            continue
        kinds, one_row = _ARRAYS[name]
        if tuple(arr.shape) != shape and not (one_row and tuple(arr.shape) == (V,)):
            want = f"{shape} or ({V},)" if one_row else f"{shape}"
            raise ValueError(
                f"{op}: {name} must have shape {want} (logits' shape), got {tuple(arr.shape)}"
            )
        if _kind(bk, arr) not in kinds:
            raise TypeError(
                f"{op}: {name} must have a {_KIND_NAMES[kinds]} dtype, got "
                f"{bk.dtype_name(arr.dtype)}"
            )


def _kind(bk: Backend, arr: Array) -> str:
    """``"b"``, ``"i"`` (signed or unsigned integer) or ``"f"`` for ``arr``'s dtype."""
    if arr.dtype == bk.xp.bool:
        return "b"
    if arr.dtype in bk.float_set:
        return "f"
    return "i" if bk.dtype_name(arr.dtype).lstrip("u").startswith("int") else "?"


def logit_bias_row(
    logit_bias: Mapping[Any, Any], /, *, vocab_size: int, op: str = "logit_bias"
) -> np.ndarray:
    """OpenAI's ``logit_bias`` (token id -> bias) as a dense float32 row ``(V,)`` for
    :func:`apply_penalties`, checked: ids in ``[0, vocab_size)`` (ints, or the strings of ints
    that JSON keys are), biases in ``[-100, 100]``."""
    V = check_int(op, "vocab_size", vocab_size, low=1)
    row = np.zeros(V, np.float32)
    for token, bias in logit_bias_items(logit_bias, vocab_size=V, op=op):
        row[token] = bias
    return row


def logit_bias_items(
    logit_bias: Mapping[Any, Any], /, *, vocab_size: int | None, op: str = "logit_bias"
) -> list[tuple[int, float]]:
    """OpenAI's ``logit_bias`` as ``(token id, bias)`` pairs, checked as
    :func:`logit_bias_row` checks it; ``vocab_size=None``: ids ``>= 0`` (a model that states no
    vocabulary: its logits bound them later), without a row of ``V`` floats."""
    if not isinstance(logit_bias, Mapping):
        raise TypeError(
            f"{op}: logit_bias must be a mapping of token ids to biases, got "
            f"{type(logit_bias).__name__}"
        )
    high = None if vocab_size is None else vocab_size - 1
    low, top = LOGIT_BIAS_RANGE
    items = []
    for key, value in logit_bias.items():
        token = key
        if isinstance(key, str):
            try:
                token = int(key, 10)
            except ValueError:
                raise ValueError(f"{op}: logit_bias key {key[:40]!r} is not a token id") from None
        token = check_int(op, f"logit_bias key {key!r}", token, low=0, high=high)
        items.append((token, check_real(op, f"logit_bias[{key!r}]", value, low=low, high=top)))
    return items
