"""Backend registry: which array libraries exist, how to load one, which one an array belongs to.

A backend is loaded lazily, the first time it is named or one of its arrays is seen, so
``import portable_llm`` imports no array library. Lookup of an array's backend is by the array's
*type*, cached, so resolving the backend of a call costs one dict lookup per array argument.
"""

from __future__ import annotations

import importlib
from typing import Any

from portable_llm.backends.base import FLOAT_DTYPES, Backend, numpy_bfloat16
from portable_llm.extras import install_hint

__all__ = [
    "ALIASES",
    "BACKENDS",
    "FLOAT_DTYPES",
    "Backend",
    "BackendNotInstalledError",
    "TOP_MODULES",
    "available_backends",
    "backend_of",
    "get_backend",
    "numpy_bfloat16",
    "resolve",
]

#: Known backend names, in the order used by reports and docs.
BACKENDS: tuple[str, ...] = ("numpy", "torch", "mlx", "jax", "array_api_strict")

_ADAPTERS = {
    "numpy": "portable_llm.backends.numpy",
    "torch": "portable_llm.backends.torch",
    "mlx": "portable_llm.backends.mlx",
    "jax": "portable_llm.backends.jax",
    "array_api_strict": "portable_llm.backends.strict",
}
#: Top-level module of an array (or dtype) type -> backend name.
TOP_MODULES: dict[str, str] = {
    "numpy": "numpy",
    "ml_dtypes": "numpy",
    "torch": "torch",
    "mlx": "mlx",
    "jax": "jax",
    "jaxlib": "jax",
    "array_api_strict": "array_api_strict",
}
#: Other names of the backends (``backend="np"``) -> backend name.
ALIASES: dict[str, str] = {
    "np": "numpy",
    "strict": "array_api_strict",
    "array-api-strict": "array_api_strict",
}
_EXTRAS = {
    "numpy": "numpy",
    "torch": "torch",
    "mlx": "mlx",
    "jax": "jax",
    "array_api_strict": "strict",
}
_SCALARS = (int, float, bool, complex, type(None))

_LOADED: dict[str, Backend] = {}
_TYPE_CACHE: dict[type, Backend] = {t: None for t in _SCALARS}  # type: ignore[misc]


class BackendNotInstalledError(ImportError):
    """A backend was asked for whose array library is not installed."""


def get_backend(name: str | Backend) -> Backend:
    """Return the loaded backend called ``name`` (``"numpy"``, ``"torch"``, ``"mlx"``, ...).

    Raises
    ------
    ValueError
        ``name`` is not a known backend; the message lists the known ones.
    BackendNotInstalledError
        The library is not installed; the message names the extra to install.
    """
    try:
        return _LOADED[name]  # type: ignore[index]
    except (KeyError, TypeError):
        pass
    if isinstance(name, Backend):
        return name
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str or None, got {type(name).__name__}")
    canonical = ALIASES.get(name, name)
    if canonical not in _ADAPTERS:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    if canonical not in _LOADED:
        adapter = importlib.import_module(_ADAPTERS[canonical])
        try:
            bk = adapter.load()
        except ImportError as exc:
            raise BackendNotInstalledError(
                f"backend {canonical!r} needs its array library, which is not installed "
                f"({exc}); install it with: {install_hint(_EXTRAS[canonical])}"
            ) from exc
        _LOADED[canonical] = bk
    bk = _LOADED[canonical]
    _LOADED[name] = bk
    return bk


def available_backends() -> list[str]:
    """Names of the backends whose library can be imported here (loads each one)."""
    names = []
    for name in BACKENDS:
        try:
            get_backend(name)
        except BackendNotInstalledError:
            continue
        names.append(name)
    return names


def _lookup_type(t: type, op: str = "") -> Backend:
    top = t.__module__.partition(".")[0]
    name = TOP_MODULES.get(top)
    if name is None:
        where = f"{op}: " if op else ""
        raise TypeError(
            f"{where}arrays of type {t.__module__}.{t.__qualname__} are not supported; "
            f"supported libraries: {', '.join(BACKENDS)} (or Python scalars)"
        )
    bk = get_backend(name)
    _TYPE_CACHE[t] = bk
    return bk


def backend_of(x: Any) -> Backend | None:
    """The backend an array belongs to, or ``None`` for a Python scalar or ``None``."""
    t = type(x)
    try:
        return _TYPE_CACHE[t]
    except KeyError:
        pass
    if isinstance(x, list | tuple):
        return None
    return _lookup_type(t)


def resolve_pair(
    op: str, backend: str | Backend | None, a: Any, b: Any, /
) -> tuple[Backend, Any, Any]:
    """:func:`resolve` for two arrays, with a fast path for two arrays of one known type.

    Tiny calls (``rms_norm`` on one token) spend most of their Python time here; the common
    case, two arrays of the same library and no ``backend=``, costs one dict lookup.
    """
    if backend is None:
        t = type(a)
        if type(b) is t:
            bk = _TYPE_CACHE.get(t)
            if bk is not None:
                return bk, a, b
    bk, (a, b) = resolve(op, backend, a, b)
    return bk, a, b


def resolve(
    op: str, backend: str | Backend | None, *arrays: Any
) -> tuple[Backend, tuple[Any, ...]]:
    """Resolve the backend of one public call and bring every array argument to it.

    ``backend=None``: the backend is inferred from the arrays (Python scalars and ``None``
    ignored); arrays of two different libraries are a ``TypeError`` naming both. A name: arrays
    of other libraries are converted to that backend (DLPack where it works, NumPy otherwise),
    onto the device of the call's first array of that backend (its default device if none).
    """
    if backend is None:
        bk: Backend | None = None
        cache = _TYPE_CACHE
        for a in arrays:
            t = type(a)
            b = cache[t] if t in cache else _lookup_type(t, op)
            if b is None or b is bk:
                continue
            if bk is not None:
                raise TypeError(
                    f"{op}: got arrays from two libraries, {bk.name} and {b.name}; "
                    f"pass backend='...' to convert them to one"
                )
            bk = b
        if bk is None:
            raise TypeError(f"{op}: no array argument to infer the backend from; pass backend=")
        return bk, arrays
    bk = get_backend(backend)
    sources = [
        _TYPE_CACHE[type(a)] if type(a) in _TYPE_CACHE else _lookup_type(type(a), op)
        for a in arrays
    ]
    if all(b is None or b is bk for b in sources):
        return bk, arrays
    # Converted arrays join the call's own arrays on their device (the first one's), never the
    # backend's default device: a NumPy weight next to a CUDA activation goes to that GPU.
    own = next((a for a, b in zip(arrays, sources, strict=True) if b is bk), None)
    device = bk.device_of(own) if own is not None else None
    return bk, tuple(
        a if b is None or b is bk else bk.convert(a, b, device)
        for a, b in zip(arrays, sources, strict=True)
    )
