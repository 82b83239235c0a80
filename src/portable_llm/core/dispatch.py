"""Choosing an implementation: the portable (pure Array API) one or a backend's native kernel.

Each op registers its portable implementation here (``@portable("rms_norm")``); each backend's
native module (``portable_llm.native.<backend>``) registers kernels with ``@native("rms_norm")``.
Every implementation has the same signature, ``fn(xp, *arrays, **options)``, so the public op
calls whichever is picked the same way.

``impl="auto"`` takes the native kernel when the backend has one and it keeps the op's meaning
for these arguments (its ``applies`` predicate), the portable one otherwise; ``"portable"``
always takes the portable one; ``"native"`` requires the native kernel. Ops may register extra
named portable implementations (``"tiled"``), and a chooser (``@auto_portable(op)``) that names
the portable implementation ``auto`` falls back to for given arguments (default ``"portable"``).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

from portable_llm.backends import ALIASES, BACKENDS
from portable_llm.backends.base import FLOAT_DTYPES, Backend

__all__ = [
    "IMPLS",
    "Dispatcher",
    "Native",
    "Trace",
    "TraceEntry",
    "auto_portable",
    "capture",
    "dispatcher",
    "native",
    "pick",
    "portable",
    "register_kernel",
    "replay",
    "trace",
    "tracing",
    "unregister_kernel",
    "variant",
]

#: The ``impl=`` values every op accepts.
IMPLS: tuple[str, ...] = ("auto", "portable", "native")

_PORTABLE: dict[str, dict[str, Callable[..., Any]]] = {}
# op -> chooser(*arrays, **options) naming the portable impl that ``auto`` falls back to.
_AUTO_PORTABLE: dict[str, Callable[..., str]] = {}
_PURE: set[Callable[..., Any]] = set()
# backend name -> op -> Native; filled when the backend's native module is imported.
_NATIVE: dict[str, dict[str, Native]] = {}
# backend name -> op -> Native registered by users (register_kernel); these win over _NATIVE.
_USER_NATIVE: dict[str, dict[str, Native]] = {}
# op -> the op it is a variant of (:func:`variant`).
_BASE_OP: dict[str, str] = {}
_NATIVE_MODULES = {
    "numpy": "portable_llm.native.numpy",
    "torch": "portable_llm.native.torch",
    "mlx": "portable_llm.native.mlx",
    "jax": "portable_llm.native.jax",
}


class Native:
    """A backend's native kernel for an op.

    ``applies(*arrays, **options)`` says whether the kernel computes the op's exact meaning for
    these arguments (``None``: always); when it does not, ``auto`` uses the portable path and
    ``impl="native"`` is an error. ``auto_dtypes`` (``None``: all) are the dtype names of the
    first array for which ``auto`` takes the kernel: a kernel that computes the op but rounds in
    another order, or at lower precision, than the reference for some dtype leaves it out
    (``impl="native"`` still runs it). ``prefer(*arrays, **options)`` (``None``: always) says
    whether ``auto`` should take a kernel that applies, for kernels that are slower than the
    portable path in some settings (a platform, eager calls). ``kernel`` names the library
    function, for reports. ``specialize(*arrays, **options)`` (``None``: none) may return the
    kernel for a weight that a model binds once, with what depends only on the weight (a
    repack, the checks) done now: ``fn(xp, x, b)`` for activations like ``arrays[0]`` (same
    dtype and rows), the same bits as the kernel; or ``None`` where it has nothing faster.
    """

    __slots__ = (
        "_auto_set",
        "applies",
        "auto_dtypes",
        "fn",
        "kernel",
        "plain",
        "prefer",
        "pure",
        "specialize",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        kernel: str,
        applies: Callable[..., bool] | None = None,
        auto_dtypes: tuple[str, ...] | None = None,
        pure: bool = False,
        prefer: Callable[..., bool] | None = None,
        specialize: Callable[..., Any] | None = None,
    ) -> None:
        self.fn = fn
        self.prefer = prefer
        self.specialize = specialize
        self.pure = pure
        self.kernel = kernel
        self.applies = applies
        self.auto_dtypes = auto_dtypes
        #: True when auto always takes it: pick() then costs one dict lookup.
        self.plain = applies is None and auto_dtypes is None and prefer is None
        self._auto_set: frozenset[Any] = frozenset()

    def bind(self, bk: Backend) -> Native:
        """Resolve ``auto_dtypes`` to ``bk``'s dtype objects and compile a pure kernel (once,
        at backend load)."""
        if self.pure:
            self.fn = bk.compile(self.fn)
            self.pure = False
        if self.auto_dtypes is not None:
            self._auto_set = frozenset(bk.dtypes[n] for n in self.auto_dtypes if n in bk.dtypes)
        return self

    def auto(self, *args: Any, **options: Any) -> bool:
        """Whether ``impl="auto"`` takes this kernel for these arguments."""
        if self.auto_dtypes is not None and args[0].dtype not in self._auto_set:
            return False
        if self.applies is not None and not self.applies(*args, **options):
            return False
        return self.prefer is None or self.prefer(*args, **options)


def portable(
    op: str, name: str = "portable", *, pure: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as the portable implementation ``name`` of ``op``.

    ``pure=True`` declares ``fn`` a pure function of its positional arrays, with hashable
    keyword-only options and no data-dependent Python control flow: a backend that compiles
    (JAX: ``jax.jit``, options static) may then run it compiled (``Backend.compile``).
    """

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _PORTABLE.setdefault(op, {})[name] = fn
        if pure:
            _PURE.add(fn)
        return fn

    return deco


def auto_portable(op: str) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """Register ``chooser(*arrays, **options) -> name``: the portable impl ``auto`` falls back to.

    Consulted only when no native kernel applies; ops without a chooser fall back to
    ``"portable"``.
    """

    def deco(fn: Callable[..., str]) -> Callable[..., str]:
        _AUTO_PORTABLE[op] = fn
        return fn

    return deco


def variant(op: str, *, of: str) -> None:
    """Declare ``op`` a variant of the op ``of``: the same meaning, signature and checks, with a
    native kernel of its own on some backends (a choice a model makes for its own products,
    e.g. ``model_linear``). Where the backend has none (or it does not apply), and for
    ``impl="portable"``, each impl of ``op`` is that of ``of``."""
    _BASE_OP[op] = of


def native(
    backend: str,
    op: str,
    *,
    kernel: str,
    applies: Callable[..., bool] | None = None,
    auto_dtypes: tuple[str, ...] | None = None,
    pure: bool = False,
    prefer: Callable[..., bool] | None = None,
    specialize: Callable[..., Any] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as ``backend``'s native kernel for ``op`` (used in native modules).

    ``pure``: as for :func:`portable`, the backend may compile it (``Backend.compile``).
    ``applies``, ``auto_dtypes``, ``prefer``, ``specialize``: see :class:`Native`.
    """

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        nat = Native(fn, kernel, applies, auto_dtypes, pure, prefer, specialize)
        _NATIVE.setdefault(backend, {})[op] = nat
        return fn

    return deco


class Dispatcher:
    """One backend's dispatch state: its native kernels, its portable implementations as it runs
    them (compiled where the backend compiles) and ``auto``'s per-dtype choices.

    Get it with :func:`dispatcher`; ops call :func:`pick`. Nothing else reads these tables.
    """

    __slots__ = ("_auto_by_dtype", "_labels", "_portable", "backend", "native")

    def __init__(self, bk: Backend) -> None:
        self.backend = bk
        module = _NATIVE_MODULES.get(bk.name)
        if module is not None:
            importlib.import_module(module)
        #: op -> the backend's native kernel (bound: dtype sets resolved, pure kernels compiled);
        #: a kernel registered with :func:`register_kernel` replaces the package's own.
        self.native: dict[str, Native] = {
            op: nat.bind(bk)
            for op, nat in {**_NATIVE.get(bk.name, {}), **_USER_NATIVE.get(bk.name, {})}.items()
        }
        self._portable: dict[tuple[str, str], Callable[..., Any]] = {}
        # (op, dtype object) -> what ``auto`` runs, for ops whose choice depends on the first
        # array's dtype alone.
        self._auto_by_dtype: dict[tuple[str, Any], Callable[..., Any]] = {}
        # implementation -> (impl name, kernel name), for traces.
        self._labels: dict[Callable[..., Any], tuple[str, str]] = {
            nat.fn: ("native", nat.kernel) for nat in self.native.values()
        }

    def __repr__(self) -> str:
        return f"Dispatcher({self.backend.name!r}, native={sorted(self.native)})"

    def install(self, op: str, nat: Native | None) -> None:
        """Make ``nat`` the native kernel of ``op`` (``None``: no native kernel) and forget
        ``auto``'s cached choices for ``op``, so the next call chooses again."""
        old = self.native.pop(op, None)
        if old is not None and all(n.fn is not old.fn for n in self.native.values()):
            self._labels.pop(old.fn, None)
        if nat is not None:
            self.native[op] = nat.bind(self.backend)
            self._labels[nat.fn] = ("native", nat.kernel)
        for key in [k for k in self._auto_by_dtype if k[0] == op]:
            del self._auto_by_dtype[key]

    def portable_impl(self, op: str, name: str = "portable") -> Callable[..., Any]:
        """The portable implementation ``name`` of ``op`` as this backend runs it (compiled when
        it is pure and the backend compiles)."""
        try:
            return self._portable[op, name]
        except KeyError:
            pass
        fn = _PORTABLE[op][name]
        run = self.backend.compile(fn) if fn in _PURE else fn
        self._portable[op, name] = run
        self._labels[run] = (name, f"{fn.__module__}.{fn.__qualname__}")
        return run

    def specialized(
        self, op: str, fn: Callable[..., Any], *args: Any, **options: Any
    ) -> Callable[..., Any] | None:
        """``fn`` (a choice of :meth:`pick` for these arguments) specialized for a weight bound
        once: the native kernel's ``specialize(*args, **options)`` when ``fn`` is that kernel
        and it offers one (see :class:`Native`), else ``None``."""
        nat = self.native.get(op)
        if nat is None or nat.specialize is None or fn is not nat.fn:
            return None
        out: Callable[..., Any] | None = nat.specialize(*args, **options)
        return out

    def label(self, fn: Callable[..., Any]) -> tuple[str, str]:
        """``(impl, kernel)`` of an implementation this dispatcher handed out."""
        return self._labels.get(fn, ("portable", getattr(fn, "__qualname__", repr(fn))))

    def pick(self, op: str, impl: str, *args: Any, **options: Any) -> Callable[..., Any]:
        """The implementation of ``op`` that ``impl`` selects for these arguments."""
        if impl == "auto":
            nat = self.native.get(op)
            if nat is not None:
                if nat.plain:
                    return nat.fn
                if nat.applies is None and nat.prefer is None:  # dtype rule: one lookup
                    key = (op, args[0].dtype)
                    fn = self._auto_by_dtype.get(key)
                    if fn is None:
                        if key[1] in nat._auto_set:
                            fn = self._auto_by_dtype[key] = nat.fn
                        else:  # cached only when no chooser looks at the shapes
                            fn = self._fallback(op, args, options)
                            if op not in _AUTO_PORTABLE and op not in _BASE_OP:
                                self._auto_by_dtype[key] = fn
                    return fn
                if nat.auto(*args, **options):
                    return nat.fn
            return self._fallback(op, args, options)
        base = _BASE_OP.get(op)
        if base is not None and (impl != "native" or op not in self.native):
            return self.pick(base, impl, *args, **options)
        if impl == "native":
            nat = self.native.get(op)
            if nat is None:
                raise ValueError(
                    f"{op}: backend {self.backend.name!r} has no native kernel; "
                    "use impl='auto' or 'portable'"
                )
            if nat.applies is not None and not nat.applies(*args, **options):
                raise ValueError(
                    f"{op}: the native kernel {nat.kernel} of backend {self.backend.name!r} "
                    f"cannot express these options ({_describe(options)}); "
                    "use impl='auto' or 'portable'"
                )
            return nat.fn
        try:
            return self.portable_impl(op, impl)
        except KeyError:
            known = (*IMPLS, *(k for k in _PORTABLE[op] if k not in IMPLS))
            raise ValueError(f"{op}: impl must be one of {known}, got {impl!r}") from None

    def _fallback(
        self, op: str, args: tuple[Any, ...], options: dict[str, Any]
    ) -> Callable[..., Any]:
        base = _BASE_OP.get(op)
        if base is not None:  # a variant without a kernel of its own that applies
            return self.pick(base, "auto", *args, **options)
        chooser = _AUTO_PORTABLE.get(op)
        return self.portable_impl(op, chooser(*args, **options) if chooser else "portable")


_DISPATCHERS: dict[Backend, Dispatcher] = {}


def dispatcher(bk: Backend) -> Dispatcher:
    """The dispatcher of a loaded backend (its native module is imported on first use)."""
    try:
        return _DISPATCHERS[bk]
    except KeyError:
        d = _DISPATCHERS[bk] = Dispatcher(bk)
        return d


# -- kernels registered by users --------------------------------------------------------------
def register_kernel(
    backend: str,
    op: str,
    fn: Callable[..., Any],
    /,
    *,
    kernel: str | None = None,
    applies: Callable[..., bool] | None = None,
    auto_dtypes: Sequence[str] | None = None,
) -> Callable[..., Any]:
    """Register ``fn`` as ``backend``'s native kernel for ``op``, without editing the package.

    ``fn(xp, *arrays, **options)`` takes the namespace and the same arguments as ``op``'s
    portable implementation (the public op validates them first) and returns the same result.
    It replaces the package's own native kernel for ``op`` on ``backend``, if any, from the next
    call on: ``impl="native"`` runs it, ``impl="auto"`` takes it where it applies,
    :func:`trace` records it and ``portable-llm report`` checks it (and the portable path beside
    it) against the float64 reference. Undo with :func:`unregister_kernel`.

    Parameters
    ----------
    backend : str
        A backend name (``"torch"``, ``"mlx"``, ``"jax"``, ``"numpy"``, ``"array_api_strict"``).
        Its library is not imported here.
    op : str
        The op (``"rms_norm"``, ``"linear"``, ``"scaled_dot_product_attention"``, ...).
    fn : callable
        The kernel.
    kernel : str, optional
        Its name in traces and reports (default: ``fn``'s module and qualified name).
    applies : callable, optional
        ``applies(*arrays, **options) -> bool``: whether ``fn`` computes ``op``'s exact meaning
        for these arguments (default: always). When it does not, ``auto`` takes the portable
        path and ``impl="native"`` is a ``ValueError``.
    auto_dtypes : sequence of str, optional
        dtype names of the first array for which ``auto`` takes ``fn`` (default: all). Leave out
        a dtype in which ``fn`` is less accurate than the portable path; ``impl="native"`` still
        runs it there.

    Returns
    -------
    callable
        ``fn``.

    Examples
    --------
    >>> import numpy as np, portable_llm as pl
    >>> def my_rms_norm(xp, x, w, *, eps):
    ...     return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
    >>> _ = pl.register_kernel("numpy", "rms_norm", my_rms_norm, kernel="my_rms_norm")
    >>> with pl.trace() as t:
    ...     _ = pl.rms_norm(np.ones((2, 4)), np.ones(4))
    >>> t[0].impl, t[0].kernel
    ('native', 'my_rms_norm')
    >>> pl.unregister_kernel("numpy", "rms_norm")
    """
    name = _backend_name(backend, "register_kernel")
    if op not in _PORTABLE:
        raise ValueError(
            f"register_kernel: unknown op {op!r}; known: {', '.join(sorted(_PORTABLE))}"
        )
    if not callable(fn):
        raise TypeError(f"register_kernel: fn must be callable, got {type(fn).__name__}")
    if applies is not None and not callable(applies):
        raise TypeError(f"register_kernel: applies must be callable, got {type(applies).__name__}")
    if kernel is None:
        named = fn if hasattr(fn, "__qualname__") else type(fn)  # a callable object: its class
        kernel = f"{named.__module__}.{named.__qualname__}"
    spec = (fn, kernel, applies, _auto_dtypes(auto_dtypes))
    _USER_NATIVE.setdefault(name, {})[op] = Native(*spec)
    for bk, d in _DISPATCHERS.items():
        if bk.name == name:
            d.install(op, Native(*spec))
    return fn


def _auto_dtypes(auto_dtypes: Sequence[str] | None) -> tuple[str, ...] | None:
    """``register_kernel``'s ``auto_dtypes`` as a tuple of known float dtype names (or None)."""
    if auto_dtypes is None:
        return None
    if isinstance(auto_dtypes, str) or not all(isinstance(d, str) for d in auto_dtypes):
        raise TypeError(
            f"register_kernel: auto_dtypes must be a sequence of dtype names, got {auto_dtypes!r}"
        )
    unknown = [d for d in auto_dtypes if d not in FLOAT_DTYPES]
    if unknown:
        raise ValueError(
            f"register_kernel: auto_dtypes names unknown float dtype(s) {unknown}; known: "
            f"{', '.join(FLOAT_DTYPES)}"
        )
    return tuple(auto_dtypes)


def unregister_kernel(backend: str, op: str) -> None:
    """Remove the kernel :func:`register_kernel` registered for ``op`` on ``backend``; the
    package's own native kernel for ``op`` (if any) is used again. ``ValueError`` when none is
    registered."""
    name = _backend_name(backend, "unregister_kernel")
    if op not in _USER_NATIVE.get(name, {}):
        raise ValueError(f"unregister_kernel: no kernel registered for {op!r} on {name!r}")
    del _USER_NATIVE[name][op]
    for bk, d in _DISPATCHERS.items():
        if bk.name == name:
            d.install(op, _NATIVE.get(name, {}).get(op))


def _backend_name(backend: str, where: str) -> str:
    name = ALIASES.get(backend, backend) if isinstance(backend, str) else backend
    if name not in BACKENDS:
        raise ValueError(f"{where}: unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    return str(name)


# -- tracing ------------------------------------------------------------------------------------
class TraceEntry(NamedTuple):
    """One implementation chosen by the dispatcher: ``op``, ``backend``, ``impl``, ``kernel``."""

    op: str
    backend: str
    impl: str
    kernel: str


class Trace(list[TraceEntry]):
    """The entries recorded inside one ``with trace() as t:`` block, in call order."""

    def ops(self, op: str) -> list[TraceEntry]:
        """The entries of one op."""
        return [e for e in self if e.op == op]


class _Open(threading.local):
    """The :func:`trace` blocks open in each thread: a block records the op calls of the
    thread that opened it (a global list let one thread's :func:`capture` clear, and its exit
    remove, another thread's blocks: ``list.remove(x): x not in list`` with 8 threads
    generating on one MLX model)."""

    def __init__(self) -> None:
        self.traces: list[Trace] = []


_OPEN = _Open()


@contextmanager
def trace() -> Iterator[Trace]:
    """Record which implementation each op call takes.

    Every choice the dispatcher makes inside the block (including those of the ops a composite
    op such as ``attention`` calls) is appended as a :class:`TraceEntry` with the fields ``op``,
    ``backend``, ``impl`` (``"native"``, ``"portable"``, ``"tiled"``, ...) and ``kernel`` (the
    library function, e.g. ``torch.nn.functional.scaled_dot_product_attention``, or the portable
    function's qualified name). Blocks nest; each sees the calls made while it is open.

    Examples
    --------
    >>> import numpy as np, portable_llm as pl
    >>> with pl.trace() as t:
    ...     _ = pl.rms_norm(np.ones((2, 4)), np.ones(4))
    >>> t[0].op, t[0].impl
    ('rms_norm', 'portable')
    """
    t = Trace()
    _OPEN.traces.append(t)
    try:
        yield t
    finally:
        _OPEN.traces.remove(t)


def tracing() -> bool:
    """Whether a :func:`trace` block is open (a forward that binds its kernels once then asks
    the dispatcher per call instead, so the trace records each kernel it runs)."""
    return bool(_OPEN.traces)


@contextmanager
def capture() -> Iterator[Trace]:
    """A :func:`trace` block whose entries go to it alone, not to the blocks open around it:
    what a compiled program records while it is traced (once), to :func:`replay` each time it
    runs."""
    traces = _OPEN.traces
    outer = traces[:]
    traces.clear()
    try:
        with trace() as t:
            yield t
    finally:
        traces[:] = outer


def replay(entries: Sequence[TraceEntry]) -> None:
    """Append ``entries`` (a :func:`capture`'s) to every open :func:`trace` block: the kernels
    that a compiled program ran, which the dispatcher saw only when it was traced."""
    for t in _OPEN.traces:
        t.extend(entries)


def _record(d: Dispatcher, op: str, fn: Callable[..., Any]) -> None:
    impl, kernel = d.label(fn)
    entry = TraceEntry(op, d.backend.name, impl, kernel)
    for t in _OPEN.traces:
        t.append(entry)


def pick(bk: Backend, op: str, impl: str, *args: Any, **options: Any) -> Callable[..., Any]:
    """The implementation of ``op`` that ``impl`` selects on ``bk`` for these arguments."""
    try:
        d = _DISPATCHERS[bk]
    except KeyError:
        d = dispatcher(bk)
    fn = d.pick(op, impl, *args, **options)
    if _OPEN.traces:
        _record(d, op, fn)
    return fn


def _describe(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in options.items())
