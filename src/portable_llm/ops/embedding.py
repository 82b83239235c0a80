"""Token embedding and the tied output projection (``unembed``)."""

from __future__ import annotations

import math

from portable_llm.backends import Backend, backend_of, resolve
from portable_llm.core.checks import check_float, check_ndim, match_weight
from portable_llm.core.dispatch import pick, portable
from portable_llm.core.types import Array, Namespace
from portable_llm.ops.quant import QuantizedWeight, quantized_embedding, quantized_linear

__all__ = ["embedding", "unembed"]

_INT_DTYPES = frozenset(f"{sign}int{bits}" for sign in ("", "u") for bits in (8, 16, 32, 64))
#: The index dtypes every library's take accepts (torch's index_select takes no other).
_INDEX_DTYPES = frozenset({"int32", "int64"})


@portable("embedding", pure=True)
def _embedding(xp: Namespace, ids: Array, table: Array) -> Array:
    flat = xp.reshape(ids, (-1,))  # (N,) -- the standard's take wants 1-D indices
    rows = xp.take(table, flat, axis=0)  # (N, E)
    return xp.reshape(rows, (*ids.shape, table.shape[1]))  # (B.., L, E)


@portable("embedding", "masked", pure=True)
def _embedding_masked(xp: Namespace, ids: Array, table: Array) -> Array:
    """Out-of-range ids give a row of NaN: the behaviour under tracing, where ids can't be read."""
    valid = (ids >= 0) & (ids < table.shape[0])  # (B.., L)
    safe = xp.where(valid, ids, xp.zeros_like(ids))
    rows = _embedding(xp, safe, table)  # (B.., L, E)
    return xp.where(valid[..., None], rows, xp.full_like(rows, xp.nan))


def _as_index(bk: Backend, ids: Array, name: str, vocab: int) -> Array:
    """``ids`` as int32 or int64, the index dtypes every library's take (and min/max) accepts.

    Narrower ids widen exactly to int32. Unsigned 32- and 64-bit ids are reinterpreted as the
    signed type of their width (uint32 as int64 when the table has more than 2**31 rows): an id
    beyond the signed range wraps to a negative one, which the range check (or, under tracing,
    the mask) then rejects, so it never lands on another token's row.
    """
    if name in _INDEX_DTYPES:
        return ids
    wide = name == "uint64" or (name == "uint32" and vocab > 2**31)
    return bk.xp.astype(ids, bk.dtype("int64" if wide else "int32"))


def _check_ids(bk: Backend, ids: Array, index: Array, vocab: int) -> None:
    """The range check on ``index`` (``ids`` as an index dtype): one min and one max reduction,
    read back to the host (a sync). The message quotes the values of ``ids`` themselves."""
    if math.prod(ids.shape) == 0:
        return
    xp = bk.xp
    lo, hi = bk.to_numpy(xp.stack([xp.min(index), xp.max(index)])).tolist()
    if lo < 0 or hi >= vocab:
        if index is not ids:  # an unsigned id may have wrapped: quote the ids as given
            host = bk.to_numpy(ids)
            lo, hi = host.min().item(), host.max().item()
        raise ValueError(
            f"embedding: ids must lie in [0, {vocab}) (the rows of table), got ids in "
            f"[{lo}, {hi}] (ids shape {tuple(ids.shape)})"
        )


def embedding(
    ids: Array, table: Array, /, *, check: bool = True, backend: str | None = None
) -> Array:
    """Look up the rows of ``table`` for token ids (``nn.Embedding``, HF ``embed_tokens``).

    Parameters
    ----------
    ids : array, shape ``(B.., L)``, integer dtype
        Token ids in ``[0, V)``, of any signed or unsigned integer width the library has (ids
        that are not int32/int64 are cast to one first: torch's ``index_select`` takes no other).
    table : array, shape ``(V, E)``, float dtype
        The embedding matrix (HF ``embed_tokens.weight``).
    check : bool
        ``True`` (default): an id outside ``[0, V)`` is a ``ValueError`` (a host read, below).
        ``False``: the ids are not read; an id outside ``[0, V)`` gives a row of NaN, as under
        tracing. For a caller that made the ids itself (a decode loop feeding back its
        sampler's ids): no device sync, so the next step can be queued before this one ran.
        A quantized ``table`` always checks.
    backend : str, optional
        Array library to compute with; inferred from the arrays when ``None``.

    Returns
    -------
    array, shape ``(B.., L, E)``, table's dtype
        ``out[..., l, :] == table[ids[..., l]]``, bit-exact. Under the
        mixed-precision rule (docs/mixed-precision.md) the table *is* the activations: there
        is no other float input, so nothing is cast and the hidden states start in the table's
        dtype (cast the table, or the result, to run a model in another dtype).

    Raises
    ------
    ValueError
        ``ids`` is not of an integer dtype, or holds an id outside ``[0, V)``. The range check
        reads ``min(ids)`` and ``max(ids)`` back to the host: one device sync per call. Under
        ``jax.jit`` (or any JAX transform) the ids are tracers whose values cannot be read, so the
        check cannot run; there an out-of-range id gives a row of NaN instead (never another
        token's row, never a wrap-around). Under ``mx.compile`` the read-back is refused by MLX:
        call ``embedding`` outside the compiled function.
    """
    if isinstance(table, QuantizedWeight):  # only the gathered rows are dequantized
        return _quantized_rows(ids, table, check=check, backend=backend)
    bk, (ids, table) = resolve("embedding", backend, ids, table)
    if backend_of(ids) is not bk:
        raise TypeError(f"embedding: ids must be an array, got {type(ids).__name__}")
    name = bk.dtype_name(ids.dtype)
    if name not in _INT_DTYPES:
        raise ValueError(
            f"embedding: ids must have an integer dtype, got {name} with shape {tuple(ids.shape)}"
        )
    check_ndim("embedding", "ids", ids, 1, "B.. x L")
    check_float("embedding", "table", table, bk)
    if table.ndim != 2:
        raise ValueError(f"embedding: table must have shape (V, E), got {tuple(table.shape)}")
    if not isinstance(check, bool):
        raise TypeError(f"embedding: check must be a bool, got {check!r}")
    index = _as_index(bk, ids, name, table.shape[0])
    if not check or bk.is_traced(ids):
        return pick(bk, "embedding", "masked")(bk.xp, index, table)
    _check_ids(bk, ids, index, table.shape[0])
    return pick(bk, "embedding", "portable")(bk.xp, index, table)


def _quantized_rows(
    ids: Array, table: QuantizedWeight, /, *, check: bool, backend: str | None
) -> Array:
    """:func:`embedding` of a quantized table: the ids checked as there (``check``), then only
    the gathered rows dequantized (equal to ``dequantize(table)[ids]``, tested)."""
    op = "embedding"
    bk, (ids,) = resolve(op, backend if backend is not None else table.backend, ids)
    if table.backend is not bk:
        table = table.to(bk, bk.device_of(ids))
    if backend_of(ids) is not bk:
        raise TypeError(f"{op}: ids must be an array, got {type(ids).__name__}")
    name = bk.dtype_name(ids.dtype)
    if name not in _INT_DTYPES:
        raise ValueError(
            f"{op}: ids must have an integer dtype, got {name} with shape {tuple(ids.shape)}"
        )
    check_ndim(op, "ids", ids, 1, "B.. x L")
    if len(table.shape) != 2:
        raise ValueError(f"{op}: table must have shape (V, E), got {table.shape}")
    vocab = table.shape[0]
    index = _as_index(bk, ids, name, vocab)
    if check and not bk.is_traced(ids):
        _check_ids(bk, ids, index, vocab)
        return quantized_embedding(index, table, bk)
    # Unchecked, or under tracing (the ids cannot be read back; MLX does not mark its traced
    # arrays, so mx.compile's step passes check=False): an out-of-range id gives a row of NaN
    # (as the float table's masked path), never another token's row.
    xp = bk.xp
    valid = (index >= 0) & (index < vocab)  # (B.., L)
    rows = quantized_embedding(xp.where(valid, index, xp.zeros_like(index)), table, bk)
    return xp.where(valid[..., None], rows, xp.full_like(rows, xp.nan))


def unembed(h: Array, table: Array, /, *, impl: str = "auto", backend: str | None = None) -> Array:
    """The tied LM head: logits ``h @ table.T`` with the embedding matrix as the weight.

    The projection is :func:`~portable_llm.ops.linear` (same kernels, same float32 accumulation for
    half-precision inputs).

    Parameters
    ----------
    h : array, shape ``(B.., L, E)``, float dtype
        Final hidden states.
    table : array, shape ``(V, E)``, float dtype
        The embedding matrix (HF ``embed_tokens.weight`` when ``tie_word_embeddings``). Cast to
        h's dtype when its float dtype differs (the
        mixed-precision rule, docs/mixed-precision.md).
    impl : {"auto", "portable", "native"}
        Passed to the linear projection.
    backend : str, optional

    Returns
    -------
    array, shape ``(B.., L, V)``, h's dtype
    """
    if isinstance(table, QuantizedWeight):
        return quantized_linear(h, table, impl=impl, backend=backend)
    bk, (h, table) = resolve("unembed", backend, h, table)
    check_float("unembed", "h", h, bk)
    check_float("unembed", "table", table, bk)
    check_ndim("unembed", "h", h, 1, "B.. x L x E")
    if table.ndim != 2 or table.shape[1] != h.shape[-1]:
        raise ValueError(
            f"unembed: table must have shape (V, {h.shape[-1]}) to match the last dimension of h "
            f"(shape {tuple(h.shape)}), got {tuple(table.shape)}"
        )
    table = match_weight("unembed", "table", table, h, bk)
    return pick(bk, "linear", impl, h, table, None)(bk.xp, h, table, None)
