"""Attention masks: causal and sliding-window, bottom-right aligned.

Query ``i`` (of ``L``) and key ``j`` (of ``S``) sit at absolute positions ``i + S - L`` and ``j``:
the last query aligns with the last key, as when ``L`` new tokens follow ``S - L`` cached ones.
Query ``i`` may attend key ``j`` iff ``j <= i + S - L`` and, with a window ``W``, also
``j > i + S - L - W`` (the ``W`` most recent positions, itself included: the HF and mlx-lm
sliding-window convention). The rule itself is :func:`portable_llm.attn.visibility.visible`.
"""

from __future__ import annotations

import math
from typing import Any

from portable_llm.attn.sdpa_args import check_window, int_option
from portable_llm.attn.visibility import visible
from portable_llm.backends import get_backend
from portable_llm.backends.base import FLOAT_DTYPES

__all__ = ["causal_mask"]


def causal_mask(
    L: int,
    S: int,
    /,
    *,
    window: int | None = None,
    dtype: Any = None,
    backend: str | None = None,
    device: Any = None,
) -> Any:
    """The causal (optionally sliding-window) mask of ``L`` queries over ``S`` keys.

    Bottom-right aligned: query ``i`` may attend key ``j`` iff ``j <= i + S - L``, and with
    ``window=W`` also ``j > i + S - L - W``. For ``L == S`` this is the lower triangle; for
    ``L < S`` (new tokens after a cache) every query also sees the ``S - L`` earlier keys; for
    ``L > S`` the first ``L - S`` queries see no key.

    Parameters
    ----------
    L, S : int, >= 0
        Number of queries and of keys (Python or NumPy integers).
    window : int, >= 1, optional
        Sliding window: each query sees at most its ``W`` most recent positions, itself included.
    dtype : str or dtype, optional
        ``None`` or ``"bool"``: a boolean mask, ``True`` where attending is allowed. A float dtype
        (``"float32"``, ``"bfloat16"``, or the backend's dtype object): an additive mask, ``0``
        where allowed and ``-inf`` elsewhere.
    backend : str, optional
        Library of the result; default NumPy.
    device : str or device, optional
        Device of the result; default the backend's default device.

    Returns
    -------
    array, shape ``(L, S)``
        Broadcasts against scores ``(B.., H, L, S)``.
    """
    L, S = (int_option("causal_mask", name, n, low=0) for name, n in (("L", L), ("S", S)))
    window = check_window("causal_mask", window)
    bk = get_backend(backend if backend is not None else "numpy")
    xp = bk.xp
    dev = bk.device(device) if device is not None else None
    keep = visible(xp, L, S, window=window, device=dev)  # (L, S)
    if dtype is None or dtype == "bool" or dtype == bk.dtypes["bool"]:
        return keep
    try:
        dt = bk.dtype(dtype, device)
    except ValueError as exc:
        raise ValueError(f"causal_mask: {exc}") from None
    if bk.dtype_name(dt) not in FLOAT_DTYPES:
        raise ValueError(
            f"causal_mask: dtype must be None, 'bool' or a float dtype, got {bk.dtype_name(dt)}"
        )
    zero = xp.zeros((L, S), dtype=dt, device=dev)
    return xp.where(keep, zero, xp.full((L, S), -math.inf, dtype=dt, device=dev))
