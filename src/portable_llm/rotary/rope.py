"""Rotary position embedding (RoPE): :func:`rope`, built from :func:`rope_cos_sin` and
:func:`apply_rope`.

The order of operations is HF transformers' (``Qwen2RotaryEmbedding`` + ``apply_rotary_pos_emb``):
angles ``position * theta_i`` in float32 (float64 for float64 input), their cos and sin times
the scaling's attention factor, cast to x's dtype, then ``x * cos + rotate_half(x) * sin`` in x's
dtype. The frequency tables ``theta_i`` come from :mod:`portable_llm.rotary.scaling`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from portable_llm.backends import resolve
from portable_llm.backends.base import FLOAT_DTYPES
from portable_llm.core.arrays import creation_device
from portable_llm.core.checks import check_float, check_ndim
from portable_llm.core.dispatch import pick, portable
from portable_llm.core.types import Array, Namespace
from portable_llm.rotary.args import (
    OP,
    check_dims_arg,
    check_positions,
    device_table,
    dispatch_args,
    max_position,
)
from portable_llm.rotary.scaling import DEFAULT_BASE, check_dims, rope_spec, uses_length

__all__ = ["apply_rope", "rope", "rope_cos_sin", "rope_tables", "rotate"]


def _angles(
    xp: Namespace, positions: Array, inv_freq: Array, attention: float
) -> tuple[Array, Array]:
    """cos and sin of ``positions * theta``, ``(.., L, dims/2)`` in the table's dtype."""
    theta = xp.expand_dims(xp.astype(positions, inv_freq.dtype), axis=-1) * inv_freq
    cos, sin = xp.cos(theta), xp.sin(theta)
    if attention != 1.0:  # yarn, longrope: HF multiplies the attention factor into cos, sin
        cos, sin = cos * attention, sin * attention
    return cos, sin


def rotate(
    xp: Namespace, x: Array, c1: Array, s1: Array, c2: Array, s2: Array, dims: int,
    traditional: bool,
) -> Array:  # fmt: skip
    """Rotate the first ``dims`` features of x ``(.., L, D)``, in x's dtype (the rotation of
    the portable RoPE kernel, after :func:`rope_tables`); ``c1, s1`` hold pair i's cos and sin
    (i < dims/2).

    ``c2, s2`` are HF's second half of cos and sin (equal to the first for RoPE's own tables),
    used by the rotate-half layout as HF uses them.
    """
    if traditional:  # pairs (2i, 2i + 1)
        even, odd = x[..., 0:dims:2], x[..., 1:dims:2]
        pairs = xp.stack([even * c1 - odd * s1, even * s1 + odd * c1], axis=-1)  # (.., L, h, 2)
        parts = [xp.reshape(pairs, (*tuple(pairs.shape)[:-2], dims))]  # (.., L, dims)
    else:  # pairs (i, i + dims/2): x * cos + rotate_half(x) * sin
        h = dims // 2
        x1, x2 = x[..., :h], x[..., h:dims]
        parts = [x1 * c1 - x2 * s1, x2 * c2 + x1 * s2]
    if dims < x.shape[-1]:
        parts.append(x[..., dims:])
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=-1)


@portable(OP)
def _rope(
    xp: Namespace,
    x: Array,
    offsets: Array,
    inv_freq: Array,
    *,
    offset: int,
    dims: int,
    traditional: bool,
    attention: float,
) -> Array:
    cos, sin = rope_tables(xp, x, offsets, inv_freq, offset=offset, attention=attention)
    return rotate(xp, x, cos, sin, cos, sin, dims, traditional)


def rope_tables(
    xp: Namespace, x: Array, offsets: Array, inv_freq: Array, *, offset: int, attention: float
) -> tuple[Array, Array]:
    """cos and sin of the portable RoPE kernel for ``x`` ``(B, .., L, D)`` at positions
    ``offsets + offset + l``: ``(L, dims/2)``, or ``(B, 1.., L, dims/2)`` for ``(B,)`` offsets,
    in x's dtype. A forward computes them once and lets every layer :func:`rotate` (the
    kernel's own two steps, so the same bits)."""
    L = x.shape[-2]
    positions = xp.arange(offset, offset + L, device=creation_device(x))  # (L,): None on MLX
    if offsets is not None:  # () -> (L,); (B,) -> (B, L)
        positions = xp.reshape(offsets, (*tuple(offsets.shape), 1)) + positions
    cos, sin = _angles(xp, positions, inv_freq, attention)  # (L, h) or (B, L, h)
    if cos.ndim == 3:  # (B, L, h) -> (B, 1.., L, h) against x (B, .., L, D)
        shape = (cos.shape[0], *(1,) * (x.ndim - 3), *tuple(cos.shape)[1:])
        cos, sin = xp.reshape(cos, shape), xp.reshape(sin, shape)
    return xp.astype(cos, x.dtype), xp.astype(sin, x.dtype)


def rope(
    x: Array,
    /,
    *,
    offset: Any = 0,
    base: float = DEFAULT_BASE,
    traditional: bool = False,
    scaling: Mapping[str, Any] | None = None,
    dims: int | None = None,
    max_position_embeddings: int | None = None,
    impl: str = "auto",
    backend: str | None = None,
) -> Array:
    """Rotary position embedding: rotate feature pairs of x by ``position * theta_i``.

    ``theta_i = base ** (-2i / dims)`` for ``i < dims / 2``, changed by ``scaling`` as HF
    transformers changes it; the position of row ``l`` of x is ``offset + l``. Equal to HF's
    rotary embedding followed by ``apply_rotary_pos_emb`` (see :func:`rope_cos_sin` and
    :func:`apply_rope`, which it is built from).

    Parameters
    ----------
    x : array, shape ``(.., L, D)`` (e.g. ``(B, H, L, D)``), float dtype
    offset : int >= 0, or integer array of shape ``()`` or ``(B,)``
        Position of the first row, a Python or NumPy integer; the last position,
        ``offset + L - 1``, must be at most ``2**31 - 1`` (``MAX_POSITION``: the position
        index is int32 on MLX and on JAX without x64). An array of shape ``(B,)`` gives each
        sequence of the batch its own start (x is then ``(B, .., L, D)``). Array offsets are
        checked for negative entries on the host (one sync).
    base : float, > 1
        HF's ``rope_theta``. A ``rope_theta`` in ``scaling`` is used instead (a different
        explicit ``base`` is an error).
    traditional : bool
        ``False``: pairs ``(i, i + dims/2)`` (HF Llama/Qwen ``rotate_half``). ``True``: pairs
        ``(2i, 2i + 1)`` (the original Llama / GPT-J interleaved layout).
    scaling : dict, optional
        An HF config's ``rope_scaling`` / ``rope_parameters`` as it is: the kind under
        ``"rope_type"`` (or ``"type"``) -- ``"default"``, ``"linear"``, ``"dynamic"``,
        ``"llama3"``, ``"yarn"``, ``"longrope"`` -- with HF's field names and defaults. A
        ``partial_rotary_factor`` in it sets ``dims = int(D * factor)``.
    dims : int, optional
        Rotate only the first ``dims`` features (even, ``<= D``; partial rotary as in Phi-2,
        GPT-NeoX); the rest pass through. Default: D (which must then be even).
    max_position_embeddings : int, optional
        The model config's field, which HF reads outside the scaling dict: needed by
        ``"dynamic"``, the default of ``original_max_position_embeddings`` for ``"llama3"``,
        ``"yarn"`` and ``"longrope"``, and longrope's default ``factor`` (over the original
        length, for its attention factor). May also be given in the dict.
    impl : {"auto", "portable", "native"}
        ``auto`` uses ``mx.fast.rope`` on MLX (given this table through ``freqs``, so every
        scaling but an attention factor (yarn's, longrope's) applies) except for float64
        input (the kernel's angles are float32); the portable path elsewhere.
    backend : str, optional

    Returns
    -------
    array, shape ``(.., L, D)``, x's dtype
        Angles in float32 (float64 for float64 x); cos and sin are rounded to x's dtype and
        the rotation happens in x's dtype, as in HF.

    Notes
    -----
    ``"dynamic"`` scaling grows its base once ``max(position) + 1`` exceeds
    ``max_position_embeddings``: that maximum is read on the host. HF additionally keeps the
    largest length it has seen; here each call uses its own positions (the same for a fresh
    model or a growing sequence). ``"longrope"`` divides by ``long_factor`` instead of
    ``short_factor`` once ``max(position) + 1`` exceeds ``original_max_position_embeddings``,
    decided per call as HF decides it per forward (keys cached before the switch keep the
    short factors, in HF too).
    """
    bk, arrays, options = dispatch_args(
        x, offset, base, traditional, scaling, dims, max_position_embeddings, backend
    )
    if 0 in tuple(arrays[0].shape):  # an empty x (D = 0 included): the empty result, the
        return bk.xp.zeros_like(arrays[0])  # same on every backend and impl
    return pick(bk, OP, impl, *arrays, **options)(bk.xp, *arrays, **options)


def rope_cos_sin(
    positions: Array,
    dims: int,
    /,
    *,
    base: float = DEFAULT_BASE,
    scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int | None = None,
    dtype: Any = None,
    backend: str | None = None,
) -> tuple[Array, Array]:
    """cos and sin of ``position * theta_i`` for arbitrary position ids, in HF's layout.

    Parameters
    ----------
    positions : integer array, shape ``(.., L)``, entries >= 0
    dims : int, even
        The rotated width (HF: ``int(head_dim * partial_rotary_factor)``); a
        ``partial_rotary_factor`` in ``scaling`` is not applied here.
    base, scaling, max_position_embeddings
        As in :func:`rope`.
    dtype : str or dtype, optional
        Of the result; default float32. Angles are float64 for float64, float32 otherwise (a
        half dtype is rounded from float32, as HF's ``cos.to(x.dtype)``).
    backend : str, optional

    Returns
    -------
    (cos, sin) : arrays, shape ``(.., L, dims)``
        HF's layout: entries ``i`` and ``i + dims/2`` both hold pair i's value (``cat(freqs,
        freqs)``), times the attention factor (yarn, longrope). For ``x`` of shape
        ``(B, H, L, D)`` and positions ``(B, L)``, pass ``cos[:, None]`` to :func:`apply_rope`
        (HF's ``unsqueeze_dim=1``).
    """
    op = "rope_cos_sin"
    bk, (positions,) = resolve(op, backend, positions)
    check_positions(op, "positions", positions, bk)
    check_ndim(op, "positions", positions, 1, ".., L")
    dims = check_dims_arg(op, dims, None, tuple(positions.shape))
    spec = rope_spec(op, scaling, base=base, max_position_embeddings=max_position_embeddings)
    check_dims(op, spec, dims)
    name = "float32" if dtype is None else bk.dtype_name(bk.dtype(dtype))
    if name not in FLOAT_DTYPES:
        raise ValueError(f"{op}: dtype must be a float dtype, got {name}")
    compute = "float64" if name == "float64" else "float32"
    seq_len = None
    if uses_length(spec) and positions.size:
        seq_len = max_position(op, bk, positions, spec.kind) + 1
    device, traced = bk.device_of(positions), bk.is_traced(positions)
    inv = device_table(bk, device, spec, dims, compute, seq_len, traced=traced)
    xp = bk.xp
    cos, sin = _angles(xp, positions, inv, spec.attention_factor)  # (.., L, dims/2)
    out = bk.dtypes[name]
    cos = xp.astype(xp.concat([cos, cos], axis=-1), out)  # (.., L, dims)
    sin = xp.astype(xp.concat([sin, sin], axis=-1), out)
    return cos, sin


def apply_rope(
    x: Array, cos: Array, sin: Array, /, *, traditional: bool = False, backend: str | None = None
) -> Array:
    """Rotate the first ``dims = cos.shape[-1]`` features of x by given cos and sin (HF's
    ``apply_rotary_pos_emb`` for one tensor).

    Parameters
    ----------
    x : array, shape ``(.., L, D)``, float dtype
    cos, sin : arrays, shape broadcastable to ``(.., L, dims)`` without enlarging x, float dtype
        HF's layout, as :func:`rope_cos_sin` returns. ``traditional=False`` computes
        ``x * cos + rotate_half(x) * sin`` on the first dims features; ``traditional=True``
        rotates pairs ``(2i, 2i + 1)`` by entry ``i`` of cos and sin (their first half).
        Cast to x's dtype first, as HF does; the rotation happens in x's dtype.
    traditional : bool
    backend : str, optional

    Returns
    -------
    array, shape ``(.., L, D)``, x's dtype
        Features ``dims:`` are x's, unchanged.
    """
    op = "apply_rope"
    bk, (x, cos, sin) = resolve(op, backend, x, cos, sin)
    for name, a in (("x", x), ("cos", cos), ("sin", sin)):
        check_float(op, name, a, bk)
    check_ndim(op, "x", x, 2, "..., L, D")
    check_ndim(op, "cos", cos, 1, "..., L, dims")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(
            f"{op}: cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    dims = check_dims_arg(op, cos.shape[-1], x.shape[-1], tuple(x.shape))
    target, given = (*tuple(x.shape)[:-1], dims), tuple(cos.shape)
    pairs = zip(reversed(given), reversed(target), strict=False)
    if len(given) > len(target) or any(c not in (1, t) for c, t in pairs):
        raise ValueError(
            f"{op}: cos and sin of shape {given} do not broadcast to {target} "
            f"(x of shape {tuple(x.shape)} with dims={dims})"
        )
    xp = bk.xp
    cos, sin = xp.astype(cos, x.dtype), xp.astype(sin, x.dtype)
    h = dims // 2
    c1, s1, c2, s2 = cos[..., :h], sin[..., :h], cos[..., h:], sin[..., h:]
    return rotate(xp, x, c1, s1, c2, s2, dims, traditional)
