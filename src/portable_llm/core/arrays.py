"""Moving arrays between libraries and devices: :func:`asarray` and :func:`to_numpy`."""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_llm.backends import Backend, backend_of, get_backend

__all__ = ["asarray", "creation_device", "device_of", "exact_divide", "to_numpy"]


def asarray(x: Any, /, *, backend: str | None = None, dtype: Any = None, device: Any = None) -> Any:
    """Convert an array of any supported library, a nested list or a scalar to a backend's array.

    Parameters
    ----------
    x : array of any supported library, nested list, or scalar
    backend : str, optional
        Target library; default: x's own library (NumPy for lists and scalars).
    dtype : str or dtype, optional
        Target dtype, as a name (``"bfloat16"``) or any library's dtype object; default: x's dtype
        (the library's default for lists). A dtype the backend lacks on that device is a
        ``ValueError`` (e.g. float64 on MLX's GPU or torch's MPS, float16 on array-api-strict).
    device : str or device, optional
        ``"cpu"``, ``"gpu"``, ``"cuda:0"``, ``"mps"``, ``"device1"`` (array-api-strict) or the
        library's own device object; default: the device x is on (the backend's default for
        lists and for arrays from another library).

    Returns
    -------
    array
        Arrays cross libraries through DLPack where the pair supports it, through NumPy otherwise
        (bfloat16 included, bit-exact).
    """
    src = backend_of(x)
    bk = get_backend(backend) if backend is not None else (src or get_backend("numpy"))
    dev = bk.device(device) if device is not None else None
    target = None if dtype is None else bk.dtype(dtype, device)
    if src is None:  # nested list or Python scalar
        return bk.xp.asarray(x, dtype=target, device=dev)
    if src is not bk:
        want = None if target is None else bk.dtype_name(target)
        if want is not None and want != src.dtype_name(x.dtype) and want in src.dtypes:
            x = src.astype(x, src.dtypes[want])  # cast where x lives, then move
        x = bk.convert(x, src, dev)  # raises for a float dtype the target lacks
    elif dev is not None:
        x = bk.to_device(x, dev)
    if target is not None and x.dtype != target:
        x = bk.astype(x, target)
    return x


def to_numpy(x: Any, /) -> np.ndarray:
    """Copy any supported array to a NumPy array on the host.

    bfloat16 comes back as ml_dtypes' ``bfloat16`` when ml_dtypes is installed (it is with the
    torch, jax and test extras), as float32 otherwise (lossless: bfloat16 is a subset of float32).
    """
    bk = backend_of(x)
    return np.asarray(x) if bk is None else bk.to_numpy(x)


def creation_device(x: Any, /) -> Any:
    """The ``device=`` of a new array made beside ``x`` (a mask, a table of positions): its
    ``device`` attribute (``None`` for MLX, whose arrays have none: unified memory), except
    for a JAX array split over several devices (a partitioned model's), whose own sharding
    would not fit an array of another rank: there its mesh, replicated (:func:`device_of`)."""
    dev = getattr(x, "device", None)
    if getattr(dev, "num_devices", 1) > 1:  # a jax.sharding.Sharding
        return device_of(x)
    return dev


def device_of(x: Any, /) -> Any:
    """The device an array lives on, as its library reports it."""
    bk: Backend | None = backend_of(x)
    if bk is None:
        raise TypeError(f"device_of: expected an array, got {type(x).__name__}")
    return bk.device_of(x)


def exact_divide(xp: Any, a: Any, b: Any, /) -> Any:
    """``a / b`` correctly rounded, ``b`` broadcast to ``a``'s shape first by a select.

    XLA rewrites a division by a broadcast operand into a multiplication by its reciprocal (two
    roundings: measured 16-70% of float32 quotients one ulp off, enough to move codes that sit
    near a rounding boundary). A select whose condition XLA cannot fold keeps a true division;
    where ``a`` is NaN the quotient is NaN either way. Elsewhere it costs one elementwise select.
    """
    return a / xp.where(xp.isnan(a), a, b)
