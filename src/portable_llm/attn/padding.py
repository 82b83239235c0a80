"""Batches of prompts of unequal length: :func:`left_pad`, and the masks of cached attention.

Row ``b`` of a left-padded batch holds ``pad_b`` pad tokens, then its prompt, so every row ends
in the last column and each decode step appends one column to all rows. Column ``c`` of row
``b`` is token ``c - pad_b`` of that prompt: its RoPE position. Masks are written in columns
(a cache's *slots* hold columns): key column ``j`` is visible to row ``b`` iff ``j >= pad_b``
(:func:`portable_llm.attn.visibility.visible`'s ``pad=``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from portable_llm.backends import Backend, backend_of, get_backend, resolve
from portable_llm.core.arrays import to_numpy

__all__ = ["left_pad"]


def left_pad(
    sequences: Sequence[Any],
    /,
    *,
    pad_id: int = 0,
    backend: str | None = None,
    device: Any = None,
) -> tuple[Any, Any]:
    """Stack token sequences of unequal length into one left-padded batch.

    Parameters
    ----------
    sequences : sequence of 1-d integer sequences or arrays
        ``B`` prompts, each of length ``>= 1``.
    pad_id : int
        The id written into the padding (any id: padded columns are masked out).
    backend : str, optional
        Library of the results; default: the library of the sequences when they are arrays,
        else NumPy.
    device : str or device, optional

    Returns
    -------
    ids : array, shape ``(B, L)``, int64
        ``L`` is the longest length; row ``b`` is ``[pad_id] * pad_b + sequences[b]``.
    left_padding : array, shape ``(B,)``, int64
        ``pad_b = L - len(sequences[b])``. Pass it to :class:`~portable_llm.KVCache` (or to
        :func:`~portable_llm.attn.block` as ``left_padding=`` without a cache); HF's
        ``attention_mask`` is ``arange(L) >= left_padding[:, None]``.
    """
    op = "left_pad"
    if isinstance(pad_id, bool) or not isinstance(pad_id, int | np.integer):
        raise ValueError(f"{op}: pad_id must be an int, got {pad_id!r}")
    if isinstance(sequences, str) or not isinstance(sequences, Sequence) or not sequences:
        raise ValueError(f"{op}: sequences must be a non-empty sequence of token sequences")
    rows = []
    for i, seq in enumerate(sequences):
        a = to_numpy(seq) if backend_of(seq) is not None else np.asarray(seq)
        if a.ndim != 1 or a.shape[0] == 0:
            raise ValueError(f"{op}: sequences[{i}] must be 1-d and non-empty, got shape {a.shape}")
        if a.dtype.kind not in "iu":
            raise ValueError(f"{op}: sequences[{i}] must hold integer ids, got dtype {a.dtype}")
        rows.append(a)
    if backend is None:
        found = next((backend_of(s) for s in sequences if backend_of(s) is not None), None)
        bk = found or get_backend("numpy")
    else:
        bk = get_backend(backend)
    L = max(len(a) for a in rows)
    ids = np.full((len(rows), L), pad_id, dtype=np.int64)  # (B, L)
    pad = np.array([L - len(a) for a in rows], dtype=np.int64)  # (B,)
    for b, a in enumerate(rows):
        ids[b, pad[b] :] = a
    dev = bk.device(device) if device is not None else None
    return bk.from_numpy(ids, dev), bk.from_numpy(pad, dev)


def row_offsets(op: str, bk: Backend, offset: Any, pad: Any, batch: int) -> Any:
    """RoPE offsets ``(B,)`` of a left-padded batch: ``offset - pad`` (< 0 on pad columns)."""
    if backend_of(pad) is None or pad.ndim != 1 or pad.shape[0] != batch:
        shape = tuple(pad.shape) if backend_of(pad) is not None else type(pad).__name__
        raise ValueError(f"{op}: left_padding must have shape (B,) = ({batch},), got {shape}")
    if not bk.dtype_name(pad.dtype).startswith(("int", "uint")):
        raise ValueError(f"{op}: left_padding must be an integer array, got {pad.dtype}")
    if backend_of(offset) is not None:
        _, (offset,) = resolve(op, bk, offset)
    return offset - pad


def nonnegative(xp: Any, rows: Any) -> Any:
    """``max(rows, 0)``: what RoPE's checks see, before the true (negative) offsets go in."""
    return xp.maximum(rows, xp.zeros_like(rows))
