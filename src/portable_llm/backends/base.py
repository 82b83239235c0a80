"""The :class:`Backend` interface each adapter module fills in for its library."""

from __future__ import annotations

from typing import Any

import numpy as np

#: Canonical float dtype names, narrowest first.
FLOAT_DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")


def numpy_bfloat16() -> Any:
    """NumPy's bfloat16 dtype from ml_dtypes, or ``None`` when ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


class Backend:
    """One loaded array library: its Array API namespace, dtypes, devices and conversions.

    Subclasses (one per library, in ``portable_llm.backends.<name>``) set ``xp`` and the dtype
    tables in ``__init__`` and override the conversion and device methods.
    """

    name: str = ""
    #: True for libraries that compile per shape (JAX): :meth:`Model.make_cache
    #: <portable_llm.Model.make_cache>` then asks each ``KVCache`` for fixed-size views
    #: (``static_shapes=True``: growing ``step`` slots at a time, the unused slots masked) instead
    #: of one more key per decode step, so a step reuses the compiled programs. A bare
    #: ``KVCache()`` returns exactly ``offset`` keys on every backend.
    static_shapes: bool = False
    #: The Array API namespace of the library (array-api-compat's, or a shim for MLX).
    xp: Any
    #: The library's version string.
    version: str = ""
    #: Canonical dtype name -> the library's dtype object (only the dtypes it has).
    dtypes: dict[str, Any]
    #: Set of the library's float dtype objects, for a one-hash check in the ops.
    float_set: frozenset[Any]

    def __init__(self) -> None:
        self.dtypes = {}
        self.float_set = frozenset()

    def _set_dtypes(self, dtypes: dict[str, Any]) -> None:
        self.dtypes = {k: v for k, v in dtypes.items() if v is not None}
        self._names = {v: k for k, v in self.dtypes.items()}
        self.float_set = frozenset(v for k, v in self.dtypes.items() if k in FLOAT_DTYPES)

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, version={self.version!r})"

    # -- dtypes ---------------------------------------------------------------------------------
    def dtype_name(self, dtype: Any) -> str:
        """Canonical name (``"bfloat16"``, ``"int64"``, ...) of one of this library's dtypes."""
        try:
            return self._names[dtype]
        except (KeyError, TypeError):
            return str(dtype).rsplit(".", 1)[-1]

    def float_dtypes(self, device: Any = None) -> tuple[str, ...]:
        """The float dtype names this backend supports on ``device`` (default device if None)."""
        return tuple(n for n in FLOAT_DTYPES if n in self.dtypes)

    def dtype(self, dtype: Any, device: Any = None) -> Any:
        """This library's dtype for a name or a dtype object of any library.

        Raises ``ValueError`` when the backend (on that device) does not have it.
        """
        if dtype in self.float_set or dtype in self._names:
            name = self._names[dtype]
        else:
            name = dtype if isinstance(dtype, str) else _foreign_dtype_name(dtype)
        if name in FLOAT_DTYPES and name not in self.float_dtypes(device):
            where = f" on device {device}" if device is not None else ""
            raise ValueError(
                f"backend {self.name!r}{where} does not support dtype {name}; "
                f"its float dtypes: {', '.join(self.float_dtypes(device))}"
            )
        try:
            return self.dtypes[name]
        except KeyError:
            raise ValueError(
                f"backend {self.name!r} has no dtype {dtype!r}; known: {', '.join(self.dtypes)}"
            ) from None

    def compile(self, fn: Any) -> Any:
        """Compile a pure portable implementation for this library (identity by default)."""
        return fn

    def synchronize(self, x: Any) -> Any:
        """Block until ``x`` (an array, or a tuple/list of arrays) is computed; return ``x``.

        Libraries that run lazily or asynchronously (MLX, JAX, torch on CUDA/MPS) wait here, so
        a timer around a call measures the work. A no-op for synchronous libraries (NumPy,
        array-api-strict, torch on the CPU).
        """
        return x

    def launch(self, x: Any) -> None:
        """Start computing ``x`` (an array, or a tuple/list of arrays) without waiting for it.

        For a lazy library (MLX: ``mx.async_eval``), so that the host can build the next piece
        of work while this one runs (a decode loop queues step ``t + 1`` before it reads token
        ``t``). A no-op where a call has started its work by the time it returns (NumPy,
        array-api-strict, torch, JAX).
        """

    def asynchronous(self, device: Any = None) -> bool:
        """Whether work on ``device`` (default: the default device) may still run after a call
        returns, so that a timer needs :meth:`synchronize` (``False``: it is a no-op there)."""
        return False

    def pipelines(self, device: Any = None) -> bool:
        """Whether a decode loop gains from queuing step ``t + 1`` (:meth:`launch`) before it
        reads token ``t`` back: the host builds the next step while ``device`` computes this
        one. Default: where work is :meth:`asynchronous`."""
        return self.asynchronous(device)

    def enable_float64(self) -> bool:
        """Make float64 available where the library needs a switch for it (JAX's process-wide
        ``jax_enable_x64``); return whether float64 is available on the default device."""
        return "float64" in self.float_dtypes()

    def set_slice(self, buf: Any, start: tuple[int, ...], value: Any) -> Any:
        """Write ``value`` into ``buf[start[0]:start[0] + value.shape[0], ...]``; return the buffer.

        In place on libraries whose arrays are mutable (NumPy, torch, MLX, array-api-strict: one
        slice assignment, cost O(value.size)); a library with immutable arrays returns an updated
        array instead (JAX). Callers always use the returned array. ``value`` must fit and have
        ``buf``'s dtype.
        """
        index = tuple(slice(s, s + n) for s, n in zip(start, value.shape, strict=True))
        buf[index] = value
        return buf

    # -- devices --------------------------------------------------------------------------------
    def device(self, spec: Any) -> Any:
        """The library's device for ``"cpu"``, ``"gpu"``, ``"cuda:0"``, ``"mps"`` or a device."""
        if spec is None or spec == "cpu":
            return None
        raise ValueError(f"backend {self.name!r} has no device {spec!r}; it runs on 'cpu' only")

    def device_of(self, x: Any) -> Any:
        """The device an array lives on."""
        return "cpu"

    def split_heads(self, device: Any, shape: tuple[int, ...], axis: int) -> Any:
        """Where a new array of ``shape`` whose ``axis`` holds heads goes, given ``device``:
        ``device`` itself, except on JAX, where a replicated ``NamedSharding`` over a 1-axis
        mesh (a tensor-parallel model's :meth:`device_of`) whose size divides
        ``shape[axis]`` becomes the same mesh split along ``axis``, so each device holds
        only its heads (a page pool's, as the model's K/V projections split them)."""
        return device

    # -- conversion -----------------------------------------------------------------------------
    def to_numpy(self, x: Any) -> np.ndarray:
        """Copy an array of this library to NumPy (bfloat16 as ml_dtypes' bfloat16)."""
        return np.asarray(x)

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        """A NumPy array (bfloat16 as ml_dtypes) as an array of this library on ``device``."""
        return self.xp.asarray(a, device=device)

    def from_dlpack(self, x: Any) -> Any:
        """Zero-copy import through DLPack; raise when the pair of libraries cannot."""
        return self.xp.from_dlpack(x)

    def to_device(self, x: Any, device: Any) -> Any:
        """Move an array of this library to ``device`` (a no-op when already there)."""
        return self.xp.asarray(x, device=device) if device is not None else x

    def astype(self, x: Any, dtype: Any) -> Any:
        return self.xp.astype(x, dtype)

    # -- random numbers (the Array API has none) ------------------------------------------------
    def rng(self, key: Any, like: Any = None) -> Any:
        """The generator or key a draw uses: ``key`` is ``None``, an int seed or the library's own.

        An int seed gives a fresh generator (key) each call, so the same seed gives the same draw;
        the library's own generator is used (and advanced) as is. ``like`` is an array of this
        library the draws go with (its device). ``TypeError``/``ValueError`` for anything else.
        This default (NumPy's ``Generator``) serves NumPy and array-api-strict.
        """
        if key is None:
            return np.random.default_rng()
        if isinstance(key, np.random.Generator):
            return key
        return np.random.default_rng(seed_value(key, "a numpy.random.Generator"))

    def uniform(self, rng: Any, shape: tuple[int, ...], like: Any) -> Any:
        """float32 draws, uniform on ``[0, 1)``, of ``shape``, on ``like``'s device."""
        return self.from_numpy(rng.random(shape, dtype=np.float32), self.device_of(like))

    def is_traced(self, x: Any) -> bool:
        """Whether ``x`` is a placeholder of a tracing transform (its values cannot be read)."""
        return False

    def convert(self, x: Any, source: Backend, device: Any = None) -> Any:
        """An array of another backend as one of this backend: DLPack first, NumPy otherwise.

        A float dtype this backend lacks (on ``device``) is a ``ValueError``, never a silent
        narrowing.
        """
        name = source.dtype_name(x.dtype)
        if name in FLOAT_DTYPES:
            self.dtype(name, device)
        try:
            out = self.from_dlpack(x)
        except Exception:  # DLPack is not supported for this pair, dtype or device.
            return self.from_numpy(source.to_numpy(x), device)
        # DLPack keeps the source's device (a host array stays on the host): move it to the one
        # asked for, else to this backend's default device (a GPU where the library defaults
        # to one), as from_numpy does.
        target = device if device is not None else self.device(None)
        return self.to_device(out, target) if target is not None else out


#: Int seeds accepted by every backend's generator: ``0 <= seed < 2**63``.
SEED_LIMIT = 2**63


def seed_value(key: Any, own: str) -> int:
    """``key`` as an int seed, or ``TypeError``/``ValueError`` naming what else (``own``) works."""
    if isinstance(key, bool) or not isinstance(key, int | np.integer):
        raise TypeError(f"key must be None, an int seed or {own}, got {type(key).__name__}")
    if not 0 <= int(key) < SEED_LIMIT:
        raise ValueError(f"key: an int seed must be in [0, 2**63), got {key}")
    return int(key)


def _foreign_dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype).rsplit(".", 1)[-1]
