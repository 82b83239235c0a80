"""RoPE's arguments: the checks, and the arrays and options its kernels take.

:func:`dispatch_args` validates a :func:`~portable_llm.rotary.rope` call once and returns what every
implementation of the ``"rope"`` op receives: ``x``, the per-sequence ``offsets`` (or ``None``)
and the frequency table on x's device, with the options ``offset``, ``dims``, ``traditional``
and ``attention`` (the factor on cos and sin). The attention block calls it once for q and k.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from portable_llm.backends import Backend, backend_of, resolve
from portable_llm.core.checks import check_float, check_int, check_ndim
from portable_llm.core.types import Array
from portable_llm.rotary.scaling import (
    DEFAULT_BASE,
    RopeSpec,
    check_dims,
    inv_freq_table,
    rope_spec,
    uses_length,
)

__all__ = [
    "MAX_POSITION",
    "check_dims_arg",
    "check_positions",
    "device_table",
    "dispatch_args",
    "max_position",
]

OP = "rope"

#: The largest position RoPE takes: ``2**31 - 1``. Positions are built with ``arange`` in the
#: backend's default integer dtype, which is int32 on MLX and on JAX without x64: one bound for
#: every backend, so a position that works on one works on all.
MAX_POSITION = 2**31 - 1


def check_dims_arg(op: str, dims: Any, D: int | None, shape: tuple[int, ...]) -> int:
    """``dims`` as an even int >= 2 (and <= ``D`` when given), or a ValueError naming both (a
    TypeError when it is not an int)."""
    dims = check_int(op, "dims", dims)
    if dims < 2 or dims % 2 or (D is not None and dims > D):
        within = f"in [2, D={D}] (x has shape {shape})" if D is not None else ">= 2"
        raise ValueError(f"{op}: dims must be an even int {within}, got {dims!r}")
    return dims


def _rotary_dims(dims: Any, spec: RopeSpec, shape: tuple[int, ...]) -> int:
    D = shape[-1]
    prf = spec.partial_rotary_factor
    if prf is not None:  # HF: int(head_dim * partial_rotary_factor)
        implied = int(D * prf)
        if dims is not None and dims != implied:
            raise ValueError(
                f"{OP}: dims={dims!r} disagrees with scaling['partial_rotary_factor']={prf!r}, "
                f"which gives int({D} * {prf}) = {implied} for x of shape {shape}"
            )
        dims = implied
    if dims is None:
        if D % 2:
            raise ValueError(
                f"{OP}: x has an odd last dimension D={D} (shape {shape}); RoPE rotates pairs of "
                "features: pass an even dims < D to rotate only the first dims"
            )
        return D
    return check_dims_arg(OP, dims, D, shape)


def check_positions(op: str, name: str, a: Array, bk: Backend) -> None:
    """An integer array with no negative entry (read on the host unless traced)."""
    kind = bk.dtype_name(a.dtype)
    if not kind.startswith(("int", "uint")):
        raise ValueError(
            f"{op}: {name} must be an integer array, got {kind} with shape {tuple(a.shape)}"
        )
    if not bk.is_traced(a) and bool(bk.xp.any(a < 0)):  # one host read
        raise ValueError(
            f"{op}: {name} must be >= 0, got negative entries (shape {tuple(a.shape)})"
        )


# (backend, device, spec, dims, dtype, seq_len) -> the table on that device. Keyed by the
# device's str: MLX's device objects do not hash by value.
_TABLES: dict[tuple[Any, ...], Any] = {}


def device_table(
    bk: Backend,
    device: Any,
    spec: RopeSpec,
    dims: int,
    dtype: str,
    seq_len: int | None,
    *,
    traced: bool = False,
) -> Array:
    """theta (``(dims/2,)``, ``dtype``) on ``device``, converted once and kept.

    ``traced``: the call runs under a trace (``jax.jit``, ``jax.grad``): the table is built for
    this trace and never stored, since an array made inside a trace must not outlive it.
    """
    if traced:
        return bk.from_numpy(inv_freq_table(spec, dims, dtype, seq_len).copy(), device)
    try:  # the device itself: two meshes of a partitioned JAX model print alike
        where: Any = (device, hash(device))[0]
    except TypeError:
        where = str(device)
    key = (bk.name, where, spec, dims, dtype, seq_len)
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= 256:
            _TABLES.clear()
        host = inv_freq_table(spec, dims, dtype, seq_len).copy()  # writable: torch shares it
        table = _TABLES[key] = bk.from_numpy(host, device)
    return table


def _is_array(a: object) -> bool:
    try:
        return backend_of(a) is not None
    except TypeError:  # a type no backend knows
        return False


def max_position(op: str, bk: Backend, a: Array, kind: str = "dynamic") -> int:
    """``max(a)`` read on the host: the one sync the ``dynamic`` and ``longrope`` scalings
    need (``kind`` names the scaling in the error for a traced ``a``)."""
    if bk.is_traced(a):
        raise ValueError(f"{op}: scaling {kind!r} needs concrete positions, got a traced array")
    return int(bk.xp.max(a))


def dispatch_args(
    x: Array,
    offset: Any = 0,
    base: float = DEFAULT_BASE,
    traditional: bool = False,
    scaling: Mapping[str, Any] | None = None,
    dims: int | None = None,
    max_position_embeddings: int | None = None,
    backend: str | Backend | None = None,
) -> tuple[Backend, tuple[Array, ...], dict[str, Any]]:
    """Validate :func:`rope`'s arguments; the backend, arrays and options its kernels take."""
    # A Python or NumPy integer (np.int64 is also a NumPy array: check it first); anything else
    # that is no array is a TypeError.
    is_int = isinstance(offset, numbers.Integral) or not _is_array(offset)
    if is_int:
        try:
            offset = check_int(OP, "offset", offset)
        except TypeError:
            raise TypeError(
                f"{OP}: offset must be an int >= 0 or an integer array, got "
                f"{type(offset).__name__} {offset!r}"
            ) from None
    bk, (x, offsets) = resolve(OP, backend, x, None if is_int else offset)
    check_float(OP, "x", x, bk)
    check_ndim(OP, "x", x, 2, "..., L, D")
    shape = tuple(x.shape)
    spec = rope_spec(OP, scaling, base=base, max_position_embeddings=max_position_embeddings)
    dims = _rotary_dims(dims, spec, shape)
    check_dims(OP, spec, dims)
    L = shape[-2]
    if is_int:
        if offset < 0:
            raise ValueError(f"{OP}: offset must be >= 0, got {offset}")
        if offset + L - 1 > MAX_POSITION:
            raise ValueError(
                f"{OP}: positions must be <= 2**31 - 1 (the int32 range of the position "
                f"index on MLX and JAX), got offset={offset} with L={L} (x of shape {shape})"
            )
    else:
        check_positions(OP, "offset", offsets, bk)
        if offsets.ndim == 1 and len(shape) < 3:
            raise ValueError(
                f"{OP}: an offset array of shape {tuple(offsets.shape)} needs x of shape "
                f"(B, .., L, D) (at least 3 dimensions), got {shape}"
            )
        if offsets.ndim > 1 or (offsets.ndim == 1 and offsets.shape[0] != shape[0]):
            raise ValueError(
                f"{OP}: an offset array must have shape () or (B,) = ({shape[0]},) for x of "
                f"shape {shape} (B, .., L, D), got {tuple(offsets.shape)}"
            )
        offset = 0
    seq_len = None
    if uses_length(spec):  # HF: max(position_ids) + 1
        seq_len = (offset if offsets is None else max_position(OP, bk, offsets, spec.kind)) + L
    dtype = "float64" if x.dtype == bk.xp.float64 else "float32"
    traced = bk.is_traced(x) or (offsets is not None and bk.is_traced(offsets))
    inv = device_table(bk, bk.device_of(x), spec, dims, dtype, seq_len, traced=traced)
    options = {"offset": offset, "dims": dims, "traditional": traditional}
    return bk, (x, offsets, inv), {**options, "attention": spec.attention_factor}
