"""Shared fixtures: the backend fixture over the backends tox selects, Hypothesis profiles."""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, settings

from portable_llm.backends import BACKENDS
from portable_llm.backends.base import FLOAT_DTYPES

_SELECTED = [
    b.strip() for b in os.environ.get("PORTABLE_LLM_BACKENDS", ",".join(BACKENDS)).split(",")
]

# CI=true: derandomized, so CI is deterministic. Locally: random, more examples.
# JAX compiles each new combination of shapes, dtypes and static options (0.1 to 0.5 s on two
# cores), which makes an example there ~50x dearer than on the other backends. Its CI run (tox
# selects JAX alone) draws fewer examples: the portable code it runs is the same code that
# numpy, torch, mlx and array-api-strict check with the full count, so the JAX run's job is the
# adapter, tracing and dtype handling, which every example exercises alike (3 examples: the
# drawn shapes still cover 1, odd and power-of-two sides across the tests).
_CI_EXAMPLES = 3 if _SELECTED == ["jax"] else 20
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=_CI_EXAMPLES,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI", "").lower() == "true" else "dev")

_MODULES = {
    "numpy": "numpy",
    "torch": "torch",
    "mlx": "mlx",
    "jax": "jax",
    "array_api_strict": "array_api_strict",
}


def skip_reason(name: str) -> str | None:
    """Why backend ``name`` does not run here (not selected, not installed), or None."""
    if name not in _SELECTED:
        return f"{name} not selected (PORTABLE_LLM_BACKENDS)"
    if importlib.util.find_spec(_MODULES[name]) is None:
        return f"{name} is not installed"
    return None


def only_on(name: str) -> pytest.MarkDecorator:
    """Skip a test that runs one backend by name (not through the ``backend`` fixture) unless
    that backend is selected: a NumPy-only check runs in the env that selects NumPy, not once in
    every backend's env."""
    reason = skip_reason(name)
    return pytest.mark.skipif(reason is not None, reason=str(reason))


#: :func:`only_on` NumPy: the benchmark and report tests that run NumPy by name.
numpy_only = only_on("numpy")


def _marks(name: str) -> list[pytest.MarkDecorator]:
    reason = skip_reason(name)
    return [] if reason is None else [pytest.mark.skip(reason=reason)]


BACKEND_PARAMS = [pytest.param(name, marks=_marks(name), id=name) for name in BACKENDS]


def _setup(name: str) -> str:
    if name == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)  # float64 reference checks on JAX
    return name


#: Dtypes whose per-dtype runs on a backend are ``slow`` (the opt-in ``tox -e slow`` runs them).
#: JAX compiles every op anew per dtype, and XLA's CPU code emulates the 2-byte floats: measured
#: on the default JAX env (2 cores, nothing else running), its bfloat16 runs took 100 s and its
#: float16 ones about as long, against 66-69 s for float32 and float64 each. The default JAX run
#: keeps float32 and float64 (the reference checks, the adapter's casts and tracing); every other
#: backend's env runs float16 and bfloat16 in full, and JAX's half dtypes still run by default
#: where a test names them otherwise (half-precision checkpoints, paged attention, mixed
#: precision, to_numpy of bfloat16).
SLOW_DTYPES: dict[str, tuple[str, ...]] = {"jax": ("float16", "bfloat16")}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.slow_on("jax", ...)``: on those backends the test is a long-running sweep
    (JAX compiles every new shape); it gets the ``slow`` marker there, which the default tox
    envs deselect and the opt-in ``tox -e slow`` runs. On the other backends it runs as usual.
    ``slow_on("jax", dtypes=("float64",))``: only its runs in those dtypes (the ``dtype``
    parameter) are slow there. Likewise a test parametrized over :data:`SLOW_DTYPES`' dtype on
    that backend."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        name = callspec.params.get("backend")
        dtype = callspec.params.get("dtype")
        mark = item.get_closest_marker("slow_on")
        if (
            mark is not None and name in mark.args and dtype in mark.kwargs.get("dtypes", (dtype,))
        ) or dtype in SLOW_DTYPES.get(name, ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> str:
    """Each selected, installed backend by name."""
    return _setup(request.param)


@pytest.fixture(scope="session", params=[p for p in BACKEND_PARAMS if p.id != "numpy"])
def other_backend(request: pytest.FixtureRequest) -> str:
    """Each selected, installed backend except NumPy (for conversion tests)."""
    return _setup(request.param)


@pytest.fixture(scope="session", params=FLOAT_DTYPES)
def dtype(request: pytest.FixtureRequest, backend: str) -> str:
    """Each float dtype the backend supports on its default device (others skip, with why)."""
    from portable_llm import get_backend

    if request.param not in get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {request.param} on its default device")
    return str(request.param)
