"""Public test helpers: the tolerance table, :func:`assert_close`, and input generation.

Use them to check your own kernels against portable_llm's reference::

    from portable_llm.testing import assert_close
    assert_close(my_kernel(x, w), pl.rms_norm(x, w))

Hypothesis strategies live in :mod:`portable_llm.testing.strategies` (needs ``hypothesis``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from portable_llm.backends import FLOAT_DTYPES, backend_of, get_backend, numpy_bfloat16
from portable_llm.core.arrays import asarray, to_numpy

__all__ = [
    "BACKEND_TOLERANCES",
    "DEEP_MODEL_TOLERANCES",
    "LATENT_DIMS",
    "MODEL_TOLERANCES",
    "TOLERANCES",
    "Tolerance",
    "assert_close",
    "random_array",
    "random_latent_layer",
    "random_weight",
    "tolerance",
]


@dataclass(frozen=True)
class Tolerance:
    """``|actual - desired| <= atol + rtol * |desired|``, elementwise, with the reason."""

    rtol: float
    atol: float
    why: str


# Inputs in the tests are O(1) (values in [-3, 3], weights scaled by 1/sqrt(fan-in)), so outputs
# are O(1) and an absolute tolerance of the same size as the relative one covers results that
# cancel to near zero. u is the unit roundoff of the dtype (half an ulp at 1).
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(
        rtol=1e-10,
        atol=1e-12,
        why="u = 1.1e-16; sums of up to 1e5 terms in another order differ by <= n*u = 1e-11. "
        "Still 1e3 below float32's u, so a path that drops to float32 fails.",
    ),
    "float32": Tolerance(
        rtol=1e-5,
        atol=1e-5,
        why="u = 6e-8; float32 accumulation of up to ~5e3 products (a 4864-wide projection) in a "
        "kernel's own blocking order gives ~sqrt(n)*u*|terms| ~ 4e-6 at unit scale; rsqrt/exp/erf "
        "add a few u. 1e-5 ~ 170u.",
    ),
    "float16": Tolerance(
        rtol=4e-3,
        atol=4e-3,
        why="u = 4.9e-4. HF's order rounds to float16 after each step (a projection, the "
        "activation, the gate product, the final projection: up to 4 roundings) and each rounding "
        "error propagates at unit gain; 4 roundings of 2u each = 8u = 4e-3.",
    ),
    "bfloat16": Tolerance(
        rtol=3.2e-2,
        atol=3.2e-2,
        why="u = 3.9e-3 (8 significand bits); the same 4 roundings as float16 at 8u = 3.1e-2.",
    ),
}


#: Where a backend cannot reach its dtype's accuracy, the measured limit, keyed by
#: (backend, dtype). Only documented library limitations belong here.
BACKEND_TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("mlx", "float64"): Tolerance(
        rtol=1e-5,
        atol=1e-5,
        why="MLX 0.32's CPU float64 stores and adds in float64, but evaluates exp (hence "
        "sigmoid, softmax, erf) with float32-accurate approximations: measured 2.3e-7 relative "
        "error for exp on [-5, 5]. Its float64 results are float32-accurate, so float32's "
        "tolerance applies.",
    ),
}


#: Whole-model logits in half precision (a decoder forward: embedding, every layer, LM head),
#: against a float64 reference on the same rounded weights, or against HF transformers in the
#: same dtype. float32 and float64 models stay within :data:`TOLERANCES`; MoE models are checked
#: here with every expert routed (``num_experts_per_tok == num_experts``): a top-k choice near a
#: tie may flip under half-precision rounding, which no tolerance covers.
MODEL_TOLERANCES: dict[str, Tolerance] = {
    "float16": Tolerance(
        rtol=2.5e-2,
        atol=2.5e-2,
        why="u = 4.9e-4. Each layer rounds to float16 about 12 times (norm, q/k/v, RoPE, "
        "attention, o_proj, residual, norm, gate, up, activation, product, down, residual); "
        "over 2 layers and the head, a worst-case sum of 25 roundings at a gain of up to 2 is "
        "50u = 2.5e-2 (relative to 1 + |logit|). Measured on the test models: at most 9e-3.",
    ),
    "bfloat16": Tolerance(
        rtol=2e-1,
        atol=2e-1,
        why="u = 3.9e-3 (8 significand bits); the float16 count, 50u = 0.2, relative to "
        "1 + |logit|. Measured on the test models: at most 0.094 against the float64 reference, "
        "0.056 against transformers in bfloat16.",
    ),
}

#: A deep model's float32 logits (tens of layers: a real checkpoint) against the same model
#: whose sums run in another order (a tensor-parallel split adds each rank's partial sum of
#: ``o_proj`` and ``down_proj`` after the products; another kernel). :data:`TOLERANCES` covers
#: the 2-layer test models; depth multiplies the roundings.
DEEP_MODEL_TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(
        rtol=1e-4,
        atol=1e-4,
        why="u = 6e-8. About 12 roundings per layer (the float16 count) over 30 layers is 360, "
        "at a gain of up to 4 is 1440u = 8.6e-5, relative to 1 + |logit|. Measured on "
        "SmolLM2-135M (30 layers) at tensor parallel 3 against one device: 9.1e-5 absolute "
        "where the logit is 2.1 (3e-5 relative to 1 + |logit|).",
    ),
}


def tolerance(dtype: Any, backend: str | None = None) -> Tolerance:
    """The tolerance for a dtype (a name or any library's dtype object) on ``backend``."""
    name = _dtype_name(dtype)
    if backend is not None and (backend, name) in BACKEND_TOLERANCES:
        return BACKEND_TOLERANCES[(backend, name)]
    return TOLERANCES[name]


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    for name in FLOAT_DTYPES:
        if str(dtype).rsplit(".", 1)[-1] == name:
            return name
    return str(np.dtype(dtype))


def _name_of(x: Any) -> str:
    bk = backend_of(x)
    return bk.dtype_name(x.dtype) if bk is not None else np.asarray(x).dtype.name


def assert_close(
    actual: Any,
    desired: Any,
    /,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    backend: str | None = None,
    dtype: Any = None,
    device: Any = None,
    err_msg: str = "",
) -> None:
    """Assert that ``actual`` matches ``desired``: backend, shape, dtype, device, then values.

    Parameters
    ----------
    actual : array
        The result under test.
    desired : array
        The expected value, of any library (typically a float64 NumPy reference).
    rtol, atol : float, optional
        Default: the entry of :data:`TOLERANCES` for the coarser dtype of the two.
    backend : str, optional
        The library ``actual`` must belong to; default: ``desired``'s library.
    dtype : str or dtype, optional
        The dtype ``actual`` must have; default: ``desired``'s dtype.
    device : optional
        The device ``actual`` must be on; default: ``desired``'s device when both come from one
        library, not checked otherwise.
    err_msg : str
        Prefixed to the failure message.
    """
    prefix = f"{err_msg}: " if err_msg else ""
    bk_a, bk_d = backend_of(actual), backend_of(desired)
    if bk_a is None:
        raise AssertionError(f"{prefix}actual is not an array: {type(actual).__name__}")
    want_bk = get_backend(backend) if backend is not None else bk_d
    if want_bk is not None and bk_a is not want_bk:
        raise AssertionError(f"{prefix}backend: actual is {bk_a.name}, expected {want_bk.name}")
    if tuple(actual.shape) != tuple(np.shape(desired) if bk_d is None else desired.shape):
        raise AssertionError(
            f"{prefix}shape: actual {tuple(actual.shape)}, expected {tuple(np.shape(desired))}"
        )
    got = _name_of(actual)
    want = _dtype_name(dtype) if dtype is not None else _name_of(desired)
    if got != want:
        raise AssertionError(f"{prefix}dtype: actual {got}, expected {want}")
    if device is not None:
        want_dev = bk_a.device(device)
        if bk_a.device_of(actual) != want_dev:
            raise AssertionError(
                f"{prefix}device: actual on {bk_a.device_of(actual)}, expected {want_dev}"
            )
    elif bk_d is bk_a and bk_a.device_of(actual) != bk_a.device_of(desired):
        raise AssertionError(
            f"{prefix}device: actual on {bk_a.device_of(actual)}, "
            f"desired on {bk_a.device_of(desired)}"
        )
    coarse = max((got, _name_of(desired)), key=_coarseness)
    tol = tolerance(coarse, bk_a.name) if coarse in TOLERANCES else None
    rtol = rtol if rtol is not None else (tol.rtol if tol else 0.0)
    atol = atol if atol is not None else (tol.atol if tol else 0.0)
    _assert_values(to_numpy(actual), to_numpy(desired), rtol, atol, prefix)


def _coarseness(name: str) -> int:
    order = ("float64", "float32", "float16", "bfloat16")
    return order.index(name) if name in order else -1


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing two arrays' values (see :func:`compare_values`)."""

    max_abs: float
    max_rel: float
    n_bad: int
    size: int
    #: Why the arrays differ, as :func:`assert_close` words it; ``""`` when they match.
    failure: str

    @property
    def ok(self) -> bool:
        return not self.failure


def compare_values(a: Any, d: Any, rtol: float, atol: float) -> Comparison:
    """:func:`assert_close`'s value check without raising: errors and the verdict.

    ``|a - d| <= atol + rtol * |d|`` elementwise in float64; NaNs and infinities must sit at the
    same positions (and infinities have the same sign). ``max_rel`` divides by ``|d|``.
    """
    a64, d64 = np.asarray(a).astype(np.float64), np.asarray(d).astype(np.float64)
    nan_a, nan_d = np.isnan(a64), np.isnan(d64)
    inf = np.isinf(a64) | np.isinf(d64)
    ok = nan_a | nan_d | inf
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.where(ok, 0.0, np.abs(a64 - d64))
        bad = err > atol + rtol * np.abs(np.where(ok, 0.0, d64))
        rel = np.where(ok, 0.0, err / np.maximum(np.abs(d64), np.finfo(np.float64).tiny))
    max_abs = float(err.max()) if err.size else 0.0
    max_rel = float(rel.max()) if rel.size else 0.0
    failure = ""
    if not np.array_equal(nan_a, nan_d):
        failure = (
            f"NaN positions differ: actual has {int(nan_a.sum())}, expected {int(nan_d.sum())}"
        )
    elif not np.array_equal(a64[inf], d64[inf]):
        failure = "infinities differ"
    elif bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err, -1.0)), err.shape) if err.ndim else ()
        failure = (
            f"{int(bad.sum())} of {bad.size} elements differ beyond "
            f"rtol={rtol:g}, atol={atol:g}: max abs error {max_abs:.3g}, "
            f"max rel error {max_rel:.3g}; worst at index {tuple(map(int, i))}: "
            f"actual {a64[i]!r}, expected {d64[i]!r}"
        )
    return Comparison(max_abs, max_rel, int(bad.sum()), int(bad.size), failure)


def _assert_values(a: np.ndarray, d: np.ndarray, rtol: float, atol: float, prefix: str) -> None:
    result = compare_values(a, d, rtol, atol)
    if not result.ok:
        raise AssertionError(f"{prefix}{result.failure}")


def random_array(
    seed: int,
    shape: tuple[int, ...],
    dtype: str,
    /,
    *,
    backend: str = "numpy",
    scale: float = 1.0,
    low: float = -3.0,
    high: float = 3.0,
    device: Any = None,
) -> tuple[Any, np.ndarray]:
    """A reproducible random input and its exact float64 NumPy copy.

    Values are uniform in ``[low, high) * scale``, rounded to ``dtype``; the returned float64
    array holds the *rounded* values, so a float64 reference computed from it sees exactly the
    input the backend sees.

    Returns
    -------
    (array of ``backend`` in ``dtype``, numpy float64 array)
    """
    rng = np.random.default_rng(seed)
    values = rng.uniform(low, high, size=shape) * scale
    np_dtype = numpy_bfloat16() if dtype == "bfloat16" else np.dtype(dtype)
    if np_dtype is None:
        raise ValueError("random_array: bfloat16 needs ml_dtypes")
    rounded = values.astype(np_dtype)
    reference = rounded.astype(np.float64)
    bk = get_backend(backend)
    if dtype in bk.dtypes:
        arr = asarray(rounded, backend=backend, device=device)
    else:
        raise ValueError(f"random_array: backend {backend!r} has no dtype {dtype}")
    return arr, reference


def random_weight(
    seed: int, shape: tuple[int, ...], dtype: str, /, *, backend: str = "numpy", device: Any = None
) -> tuple[Any, np.ndarray]:
    """A weight drawn like ``torch.nn.Linear``'s init: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``.

    ``fan_in`` is the last dimension, so with unit-scale inputs the layer's outputs stay O(1),
    the scale the :data:`TOLERANCES` assume. Returns ``(array, float64 copy)`` as
    :func:`random_array`.
    """
    bound = shape[-1] ** -0.5
    return random_array(seed, shape, dtype, backend=backend, low=-bound, high=bound, device=device)


#: The sizes of :func:`random_latent_layer` that are :func:`~portable_llm.latent_attention`'s
#: keyword arguments (the rest: ``hidden_size``, ``q_lora_rank``, ``out_size``).
LATENT_DIMS = ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def random_latent_layer(
    seed: int, sizes: dict[str, Any], dtype: str, /, *, backend: str = "numpy"
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A multi-head latent attention layer's weights, as :func:`random_weight` draws them.

    ``sizes``: HF ``DeepseekV3Config`` names, ``hidden_size`` ``E``, ``num_heads``,
    ``q_lora_rank`` (``None``: a plain ``wq``), ``kv_lora_rank``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim``, ``v_head_dim``, and ``out_size`` (``o_proj``'s rows). Returns the
    ``latent_attention`` keyword arguments on ``backend`` and their float64 copies (the norm
    weights in ``[0.5, 1.5)``); the sizes of :data:`LATENT_DIMS` are not among them.
    """
    E, H, rq = sizes["hidden_size"], sizes["num_heads"], sizes["q_lora_rank"]
    R, dn, dr, dv = (sizes[n] for n in LATENT_DIMS[1:])
    shapes: dict[str, tuple[int, ...]] = {
        "wkv_a": (R + dr, E), "kv_a_norm": (R,), "wkv_b": (H * (dn + dv), R),
        "wo": (sizes["out_size"], H * dv),
    }  # fmt: skip
    if rq is None:
        shapes["wq"] = (H * (dn + dr), E)
    else:
        shapes.update(wq_a=(rq, E), q_a_norm=(rq,), wq_b=(H * (dn + dr), rq))
    arrays, refs = {}, {}
    for i, (name, shape) in enumerate(shapes.items()):
        if name.endswith("_norm"):
            a, r = random_array(seed + i, shape, dtype, backend=backend, low=0.5, high=1.5)
        else:
            a, r = random_weight(seed + i, shape, dtype, backend=backend)
        arrays[name], refs[name] = a, r
    return arrays, refs
