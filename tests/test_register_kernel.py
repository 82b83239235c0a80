"""``pl.register_kernel``: a user's own native kernel, picked up by dispatch, trace and report."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.cli import report
from portable_llm.cli.cli import main
from portable_llm.core.dispatch import TraceEntry, dispatcher
from portable_llm.testing import assert_close, random_array, reference


class Counting:
    """A kernel that counts its calls; ``wrong`` adds 0.5 (a broken kernel)."""

    def __init__(self, wrong: bool = False) -> None:
        self.calls = 0
        self.wrong = wrong

    def __call__(self, xp, x, w, *, eps):
        self.calls += 1
        # float32 accumulation, as the portable path; the input dtype out. w is None for the
        # weightless norm (Llama 4's q/k norm): an rms_norm kernel gets that call too.
        x32 = xp.astype(x, xp.float32) if x.dtype != xp.float64 else x
        ms = xp.mean(x32 * x32, axis=-1, keepdims=True)
        out = xp.astype(x32 / xp.sqrt(ms + eps), x.dtype)
        out = out if w is None else out * w
        return out + 0.5 if self.wrong else out


@pytest.fixture
def registered(request) -> Iterator[list[tuple[str, str]]]:
    """Names to unregister after the test, whatever happened."""
    done: list[tuple[str, str]] = []
    yield done
    for backend, op in done:
        pl.unregister_kernel(backend, op)


def _x_w(backend: str, dtype: str = "float32", shape=(2, 3, 16)):
    x = random_array(0, shape, dtype, backend=backend)
    w = random_array(1, shape[-1:], dtype, backend=backend, low=0.5, high=1.5)
    return x, w


def test_registered_kernel_is_taken_by_auto_native_and_trace(backend, registered):
    bk = pl.get_backend(backend)
    (x, xr), (w, wr) = _x_w(backend)
    before = pl.rms_norm(x, w)  # the dispatcher exists and auto's choice for float32 is cached
    with pl.trace() as t0:
        pl.rms_norm(x, w)
    kernel = Counting()
    assert pl.register_kernel(backend, "rms_norm", kernel, kernel="my.rms_norm") is kernel
    registered.append((backend, "rms_norm"))
    with pl.trace() as t:
        auto = pl.rms_norm(x, w, eps=1e-6)
        native = pl.rms_norm(x, w, eps=1e-6, impl="native")
        portable = pl.rms_norm(x, w, eps=1e-6, impl="portable")
    assert kernel.calls == 2
    assert [e.impl for e in t] == ["native", "native", "portable"]
    assert t[0] == TraceEntry("rms_norm", backend, "native", "my.rms_norm")
    want = reference.rms_norm(xr, wr, 1e-6)
    for out in (auto, native, portable):
        assert_close(out, want, backend=backend, dtype="float32")
    # Unregistered: the backend's own choice again (its native kernel, if any, or portable).
    pl.unregister_kernel(backend, "rms_norm")
    registered.clear()
    with pl.trace() as t1:
        after = pl.rms_norm(x, w)
    assert t1 == t0
    assert_close(after, before, rtol=0, atol=0)
    assert kernel.calls == 2
    nat = dispatcher(bk).native.get("rms_norm")
    assert nat is None or nat.kernel != "my.rms_norm"


def test_applies_and_auto_dtypes_limit_auto(registered):
    kernel = Counting()
    pl.register_kernel("numpy", "rms_norm", kernel, applies=lambda x, w, *, eps: x.ndim == 2,
                       auto_dtypes=("float32",))  # fmt: skip
    registered.append(("numpy", "rms_norm"))
    (x3, _), (w, _) = _x_w("numpy")
    (x2, _), _ = _x_w("numpy", shape=(4, 16))
    x64 = x2.astype(np.float64)
    with pl.trace() as t:
        pl.rms_norm(x3, w)  # 3-D: does not apply
        pl.rms_norm(x2, w)  # 2-D float32: auto takes it
        pl.rms_norm(x64, w.astype(np.float64))  # float64: not among auto_dtypes
        pl.rms_norm(x64, w.astype(np.float64), impl="native")  # ... but native runs it
    assert [e.impl for e in t] == ["portable", "native", "portable", "native"]
    # The default kernel name: the function's module and qualified name.
    assert t[1].kernel == f"{__name__}.Counting"
    assert kernel.calls == 2
    with pytest.raises(ValueError, match=r"rms_norm: the native kernel .* cannot express"):
        pl.rms_norm(x3, w, impl="native")


def test_report_checks_a_registered_kernel_and_the_portable_path(registered, capsys):
    pl.register_kernel("numpy", "rms_norm", Counting(), kernel="my.rms_norm")
    registered.append(("numpy", "rms_norm"))
    code = main(["report", "-v", "--backend", "numpy", "--op", "rms_norm", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = report.check_case(pl.get_backend("numpy"), _case("rms_norm"), "float32")
    assert [(r.impl, r.path, r.result) for r in rows] == [
        ("auto", "my.rms_norm", "ok"),
        ("portable", "portable", "ok"),
    ]
    assert "my.rms_norm" in out
    # --op rms_norm runs every case of the op, the weightless norm too (w=None to the kernel)
    rows = report.check_case(pl.get_backend("numpy"), _case("rms_norm(no weight)"), "float32")
    assert [(r.impl, r.path, r.result) for r in rows] == [
        ("auto", "my.rms_norm", "ok"),
        ("portable", "portable", "ok"),
    ]
    assert "rms_norm(no weight): my.rms_norm" in out


def test_report_fails_a_wrong_registered_kernel(registered, capsys):
    pl.register_kernel("numpy", "rms_norm", Counting(wrong=True), kernel="my.rms_norm")
    registered.append(("numpy", "rms_norm"))
    code = main(["report", "--backend", "numpy", "--op", "rms_norm", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL: numpy rms_norm float32 impl=auto" in out
    rows = report.check_case(pl.get_backend("numpy"), _case("rms_norm"), "float32")
    assert [(r.impl, r.result) for r in rows] == [("auto", "FAIL"), ("portable", "ok")]


def _case(name: str) -> report.Case:
    return next(c for c in report.CASES if c.name == name)


def test_registration_before_the_backend_is_loaded_wins_over_the_packages_kernel(backend):
    # A fresh process: the kernel is registered before the backend (and its native module, which
    # registers the package's own kernels) is loaded; the user's kernel still wins.
    import subprocess
    import sys

    code = (
        "import numpy as np, portable_llm as pl\n"
        "def k(xp, x, w, *, eps):\n    return x * 0 + 7\n"
        f"pl.register_kernel({backend!r}, 'rms_norm', k, kernel='seven')\n"
        f"x = pl.asarray(np.ones((2, 4)), backend={backend!r}, dtype='float32')\n"
        f"w = pl.asarray(np.ones(4), backend={backend!r}, dtype='float32')\n"
        "with pl.trace() as t:\n    y = pl.rms_norm(x, w)\n"
        "print(t[0].kernel, float(pl.to_numpy(y)[0, 0]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["seven", "7.0"]


def test_bad_registrations_are_clear_errors():
    def k(xp, x, w, *, eps):
        return x

    with pytest.raises(ValueError, match="register_kernel: unknown backend 'tensorflow'"):
        pl.register_kernel("tensorflow", "rms_norm", k)
    with pytest.raises(
        ValueError, match=r"register_kernel: unknown op 'rms_nrom'; known: .*rms_norm"
    ):
        pl.register_kernel("numpy", "rms_nrom", k)
    with pytest.raises(TypeError, match="register_kernel: fn must be callable"):
        pl.register_kernel("numpy", "rms_norm", "k")
    with pytest.raises(TypeError, match="register_kernel: auto_dtypes must be a sequence"):
        pl.register_kernel("numpy", "rms_norm", k, auto_dtypes="float32")
    with pytest.raises(ValueError, match=r"register_kernel: auto_dtypes names unknown .*'f32'"):
        pl.register_kernel("numpy", "rms_norm", k, auto_dtypes=("f32",))
    with pytest.raises(ValueError, match="unregister_kernel: no kernel registered for 'rms_norm'"):
        pl.unregister_kernel("numpy", "rms_norm")
    # Nothing was registered by the failed calls.
    with pl.trace() as t:
        pl.rms_norm(np.ones((1, 4)), np.ones(4))
    assert t[0].impl == "portable"
