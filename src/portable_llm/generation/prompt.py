"""The checks every generation front shares: prompt ids, stop ids, sampling options.

:func:`~portable_llm.generate`, :class:`~portable_llm.BatchGenerator` and
:func:`~portable_llm.speculative_generate` call these before the model runs, so a bad argument
is the same ``TypeError``/``ValueError``, naming it, whichever front it went to.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from portable_llm.backends import backend_of
from portable_llm.core.arrays import to_numpy
from portable_llm.core.checks import check_int, check_optional_int, check_real
from portable_llm.generation.protocol import LanguageModel, vocab_size
from portable_llm.generation.tokenizer import text_tokenizer

__all__ = ["batch_ids", "is_text_batch", "prompt_ids", "sampling_options", "stop_ids"]


def prompt_ids(
    model: LanguageModel,
    prompt: Any,
    /,
    *,
    op: str = "generate",
    name: str = "prompt",
    text: bool = True,
) -> list[int]:
    """A prompt's token ids, checked: non-empty, each in ``[0, model.vocab_size)`` (``>= 0``
    for a model without ``vocab_size``: the first logits tell ``V``).

    Parameters
    ----------
    model : LanguageModel
    prompt : str, a sequence of ints, or a 1-D integer array (any backend)
        A string is encoded with ``model.tokenizer.encode_prompt`` (no BOS added where the text
        starts with the tokenizer's ``bos_token``, as a rendered chat template does), or the
        ``encode`` of another library's tokenizer (:func:`~portable_llm.generation.tokenizer.
        text_tokenizer`).
    op, name : str
        The caller and the argument, for the messages.
    text : bool
        Whether a string is accepted (``False``: ids only).

    Returns
    -------
    list of int, shape ``(L,)``, ``L >= 1``

    Raises
    ------
    ValueError
        A string without a tokenizer, a shape other than ``(L,)``, no tokens, an id outside
        ``[0, V)``.
    """
    if isinstance(prompt, str) and text:
        if model.tokenizer is None:
            raise ValueError(f"{op}: a text prompt needs the checkpoint's tokenizer.json")
        ids = [int(i) for i in text_tokenizer(model.tokenizer).encode_prompt(prompt)]
    else:
        ids = _ids(prompt, op, name, text)
    if not ids:
        raise ValueError(f"{op}: {name} has no tokens")
    V = vocab_size(model)
    low, high = min(ids), max(ids)
    if low < 0 or (V is not None and high >= V):
        raise ValueError(
            f"{op}: {name}: token ids must lie in [0, {V}) (vocab_size), got {low} to {high}"
        )
    return ids


def batch_ids(
    model: LanguageModel, ids: Any, /, *, op: str = "generate_step", name: str = "ids"
) -> tuple[np.ndarray, bool]:
    """Token ids of shape ``(L,)`` or ``(B, L)`` (a sequence or an integer array of any
    backend), checked: integers, ``B, L >= 1``, each in ``[0, model.vocab_size)``.

    Returns
    -------
    (host, single) : NumPy int64 ``(B, L)``, and whether ``ids`` was 1-D (``B = 1``)

    Raises
    ------
    ValueError
        Another rank, a non-integer dtype, no tokens, an id outside ``[0, V)``.
    """
    if isinstance(ids, str | bytes):
        raise ValueError(
            f"{op}: {name} must be token ids (ints) of shape (L,) or (B, L), got "
            f"{type(ids).__name__} (encode text with model.tokenizer.encode_prompt)"
        )
    try:
        host = np.asarray(to_numpy(ids) if backend_of(ids) is not None else ids)
    except ValueError:  # ragged nesting: NumPy's "inhomogeneous shape"
        raise ValueError(f"{op}: {name} must have shape (L,) or (B, L), got ragged rows") from None
    if host.ndim not in (1, 2) or (host.size and host.dtype.kind not in "iu"):
        raise ValueError(
            f"{op}: {name} must be token ids (ints) of shape (L,) or (B, L), got shape "
            f"{host.shape} of {host.dtype}"
        )
    single = host.ndim == 1
    host = host.astype(np.int64).reshape((1, -1) if single else host.shape)
    if host.size == 0:
        raise ValueError(f"{op}: {name} has no tokens (shape {host.shape}): give at least one")
    V, low, high = vocab_size(model), int(host.min()), int(host.max())
    if low < 0 or (V is not None and high >= V):
        raise ValueError(
            f"{op}: {name}: token ids must lie in [0, {V}) (vocab_size), got {low} to {high}"
        )
    return host, single


def is_text_batch(prompt: Any) -> bool:
    """Whether ``prompt`` is a non-empty list or tuple of strings (a batch of text prompts)."""
    return (
        isinstance(prompt, list | tuple)
        and len(prompt) > 0
        and all(isinstance(p, str) for p in prompt)
    )


def stop_ids(
    model: LanguageModel | None, stop: Any, /, *, op: str = "generate", ignore_eos: bool = False
) -> frozenset[int]:
    """The stop token ids: ``model.eos_token_ids`` when ``stop`` is ``None`` (none with
    ``ignore_eos``), else ``stop`` (an iterable of ints, or an integer array), checked; ``()``:
    none. ``model`` may be ``None`` when ``stop`` is given."""
    if not isinstance(ignore_eos, bool):
        raise TypeError(f"{op}: ignore_eos must be a bool, got {type(ignore_eos).__name__}")
    if stop is None:
        if ignore_eos or model is None:
            return frozenset()
        return frozenset(int(i) for i in model.eos_token_ids)
    plain = str | bytes | list | tuple | set | frozenset | range
    if not isinstance(stop, plain) and backend_of(stop) is not None:  # an array of ids
        stop = to_numpy(stop).reshape(-1).tolist()
    if isinstance(stop, str | bytes) or not isinstance(stop, Iterable):
        raise TypeError(
            f"{op}: stop must be an iterable of token ids (ints) or None, got "
            f"{type(stop).__name__} {stop!r}"
        )
    return frozenset(check_int(op, f"stop[{i}]", s) for i, s in enumerate(stop))


def sampling_options(
    temperature: Any,
    top_k: Any,
    top_p: Any,
    min_p: Any,
    /,
    *,
    vocab_size: int | None,
    op: str = "generate",
) -> dict[str, Any]:
    """:func:`~portable_llm.sample`'s options, checked as it checks them, as Python numbers:
    ``temperature >= 0``, ``top_k`` in ``[1, vocab_size]`` (``>= 1`` for ``None``), ``top_p``
    in ``(0, 1]``, ``min_p`` in ``[0, 1]`` (each but ``temperature`` may be ``None``)."""
    top_p = None if top_p is None else check_real(op, "top_p", top_p, low=0, low_open=True, high=1)
    return {
        "temperature": check_real(op, "temperature", temperature, low=0),
        "top_k": check_optional_int(op, "top_k", top_k, low=1, high=vocab_size),
        "top_p": top_p,
        "min_p": None if min_p is None else check_real(op, "min_p", min_p, low=0, high=1),
    }


def _ids(prompt: Any, op: str, name: str, text: bool) -> list[int]:
    """Token ids of a sequence or a 1-D integer array, as ints."""
    accepted = "a 1-D sequence of token ids (ints) or a 1-D integer array"
    if text:
        accepted = f"a str, {accepted}"
    if isinstance(prompt, str | bytes):
        raise ValueError(
            f"{op}: {name} must be {accepted}, got {type(prompt).__name__} {prompt[:40]!r} "
            "(encode text with model.tokenizer.encode_prompt)"
        )
    if backend_of(prompt) is not None:
        prompt = to_numpy(prompt)
    try:
        arr = np.asarray(prompt)
    except ValueError:  # ragged nesting: NumPy's "inhomogeneous shape"
        raise ValueError(
            f"{op}: {name} must be {accepted}, got a ragged nested {type(prompt).__name__}"
        ) from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{op}: {name} must be {accepted}, got shape {arr.shape} of {arr.dtype}")
    return [int(i) for i in arr]
