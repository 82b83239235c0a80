"""The Array API namespace for MLX: ``mlx.core`` with its few gaps filled.

MLX arrays carry no device (memory is unified; the default device or a stream decides where work
runs), its creation functions reject ``device=``, and it spells ``bool`` as ``bool_``. Everything
else is ``mlx.core`` itself, copied into one namespace object so attribute access stays fast.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np


def make_namespace(mx: Any) -> types.SimpleNamespace:
    ns = types.SimpleNamespace(**{k: getattr(mx, k) for k in dir(mx) if not k.startswith("__")})

    def _no_device(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, device: Any = None, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        wrapped.__name__ = fn.__name__
        return wrapped

    for name in (
        "zeros",
        "ones",
        "full",
        "arange",
        "eye",
        "linspace",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty",
        "empty_like",
        "tri",
    ):
        if hasattr(mx, name):
            setattr(ns, name, _no_device(getattr(mx, name)))

    def asarray(obj: Any, /, *, dtype: Any = None, device: Any = None, copy: Any = None) -> Any:
        if isinstance(obj, mx.array):
            return obj if dtype is None or obj.dtype == dtype else obj.astype(dtype)
        if isinstance(obj, list | tuple):
            try:
                return mx.array(obj, dtype=dtype)
            except ValueError:  # NumPy scalars in a list ("Invalid type int64 received")
                obj = np.asarray(obj)  # their NumPy dtype, as torch and JAX read them
        return mx.array(obj, dtype=dtype)

    def astype(x: Any, dtype: Any, /, *, copy: bool = True, device: Any = None) -> Any:
        return x if (not copy and x.dtype == dtype) else x.astype(dtype)

    # Indices carry no gradient. MLX keeps them in the graph of their input, and mx.grad then
    # fails at the first gather that uses them ("Cannot calculate VJP with respect to
    # indices"): cut them from the graph, as the Array API's integer results are.
    def argsort(x: Any, /, *, axis: int = -1, descending: bool = False, stable: bool = True) -> Any:
        # mx.argsort is stable and ascending only. Descending and still stable (ties keep their
        # order): sort the reversed array ascending, map back, reverse the result.
        if not descending:
            return mx.stop_gradient(mx.argsort(x, axis=axis))
        x = mx.moveaxis(x, axis, -1)
        n = x.shape[-1]
        idx = (n - 1) - mx.argsort(x[..., ::-1], axis=-1)[..., ::-1]
        return mx.stop_gradient(mx.moveaxis(idx, -1, axis))

    def _index(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return mx.stop_gradient(fn(*args, **kwargs))

        wrapped.__name__ = fn.__name__
        return wrapped

    ns.argmax = _index(mx.argmax)
    ns.argmin = _index(mx.argmin)

    ns.asarray = asarray
    ns.astype = astype
    ns.argsort = argsort
    ns.bool = mx.bool_
    ns.__name__ = "portable_llm.backends.mlx_compat"
    return ns
