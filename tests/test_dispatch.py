"""Backend inference, conversion between libraries, devices, dtypes, impl selection."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.backends import BACKENDS, resolve
from portable_llm.core.dispatch import IMPLS, dispatcher
from portable_llm.testing import assert_close, random_array, reference


def test_import_loads_no_backend_library():
    code = (
        "import sys, portable_llm\n"
        "print(sorted(m for m in ('torch', 'mlx', 'jax', 'array_api_strict', 'ml_dtypes')"
        " if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_backend_names_the_extra():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import portable_llm as pl\n"
        "try:\n    pl.get_backend('torch')\n"
        "except pl.BackendNotInstalledError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install -c constraints.txt -e '.[torch]' (in a clone" in out.stdout


def test_unknown_backend_lists_known_ones():
    with pytest.raises(ValueError, match="unknown backend 'tensorflow'") as info:
        pl.rms_norm(np.ones((2, 4)), np.ones(4), backend="tensorflow")
    for name in BACKENDS:
        assert name in str(info.value)


def test_unknown_array_library_is_a_type_error():
    class FakeArray:
        shape = (2, 4)

    with pytest.raises(TypeError, match=r"arrays of type .*FakeArray are not supported"):
        pl.silu(FakeArray())


def test_backend_is_inferred_and_kept(backend, dtype):
    x, xr = random_array(0, (2, 3, 16), dtype, backend=backend)
    w, wr = random_array(1, (16,), dtype, backend=backend)
    out = pl.rms_norm(x, w)  # no backend=: inferred from x and w
    assert_close(out, reference.rms_norm(xr, wr), backend=backend, dtype=dtype)
    assert_close(out, pl.rms_norm(x, w, backend=backend))  # same device as the inputs


def test_backend_name_converts_numpy_inputs(backend, dtype):
    x, xr = random_array(0, (2, 16), dtype)
    w, wr = random_array(1, (16,), dtype)
    out = pl.rms_norm(x, w, eps=1e-6, backend=backend)
    assert_close(out, reference.rms_norm(xr, wr, 1e-6), backend=backend, dtype=dtype)


def test_two_libraries_without_backend_name_both(other_backend):
    x = pl.asarray(np.ones((2, 4), np.float32), backend=other_backend)
    with pytest.raises(TypeError, match=rf"rms_norm: .*two libraries, {other_backend} and numpy"):
        pl.rms_norm(x, np.ones(4, np.float32))
    # Naming a backend converts the odd one out instead.
    out = pl.rms_norm(x, np.ones(4, np.float32), backend=other_backend)
    assert_close(out, reference.rms_norm(np.ones((2, 4)), np.ones(4)), backend=other_backend,
                 dtype="float32")  # fmt: skip


def test_python_scalars_and_none_are_ignored_by_inference(backend):
    x = pl.asarray([1.0, 2.0], backend=backend, dtype="float32")
    bk, arrays = resolve("op", None, x, 3.0, None, 2)
    assert bk.name == backend and arrays[1:] == (3.0, None, 2)


@pytest.mark.parametrize("target", BACKENDS)
def test_asarray_round_trips_bits_between_backends(backend, dtype, target):
    bk = pl.get_backend(backend)  # skips come from the fixtures
    try:
        tgt = pl.get_backend(target)
    except pl.BackendNotInstalledError:
        pytest.skip(f"{target} is not installed")
    if dtype not in tgt.float_dtypes():
        pytest.skip(f"{target} has no {dtype}")
    x, xr = random_array(3, (4, 5), dtype, backend=backend)
    y = pl.asarray(x, backend=target)
    assert type(y).__module__.split(".")[0] in {target, "jaxlib"} or tgt.name == "numpy"
    assert_close(y, xr, backend=target, dtype=dtype, rtol=0.0, atol=0.0)
    back = pl.asarray(y, backend=bk.name)
    assert_close(back, x, rtol=0.0, atol=0.0)


def test_asarray_from_nested_list_and_dtype_names(backend, dtype):
    y = pl.asarray([[1.0, -2.5], [0.25, 3.0]], backend=backend, dtype=dtype)
    assert_close(y, np.array([[1.0, -2.5], [0.25, 3.0]]), backend=backend, dtype=dtype, atol=0,
                 rtol=0)  # fmt: skip
    # A dtype object of another library names the same dtype.
    z = pl.asarray(y, dtype=np.float32)
    assert_close(z, np.array([[1.0, -2.5], [0.25, 3.0]]), backend=backend, dtype="float32")


def test_to_numpy_bfloat16_is_ml_dtypes(backend):
    if "bfloat16" not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no bfloat16")
    import ml_dtypes

    out = pl.to_numpy(pl.asarray([1.0, 0.1], backend=backend, dtype="bfloat16"))
    assert out.dtype == np.dtype(ml_dtypes.bfloat16)
    assert out.astype(np.float64)[1] == float(np.float32(ml_dtypes.bfloat16(0.1)))


def test_unsupported_dtype_is_a_clear_error():
    strict = pytest.importorskip("array_api_strict")
    del strict
    with pytest.raises(ValueError, match="'array_api_strict' does not support dtype float16"):
        pl.asarray(np.ones(3, np.float16), backend="array_api_strict")
    with pytest.raises(ValueError, match="does not support dtype bfloat16"):
        pl.asarray([1.0], backend="array_api_strict", dtype="bfloat16")


def test_mlx_gpu_declares_no_float64():
    mx = pytest.importorskip("mlx.core")
    bk = pl.get_backend("mlx")
    for gpu in (mx.gpu, mx.Device(mx.gpu), "gpu", "mps"):
        assert "float64" not in bk.float_dtypes(gpu)
    assert bk.float_dtypes(mx.cpu) == ("float16", "bfloat16", "float32", "float64")
    assert bk.device("cpu") == mx.Device(mx.cpu)


def test_torch_mps_declares_no_float64():
    torch = pytest.importorskip("torch")
    bk = pl.get_backend("torch")
    assert "float64" not in bk.float_dtypes(torch.device("mps"))
    assert bk.float_dtypes(torch.device("cpu")) == ("float16", "bfloat16", "float32", "float64")


@pytest.mark.parametrize("device", ["gpu", "cuda:0", "mps"])
def test_device_that_is_absent_is_a_clear_error(other_backend, device):
    bk = pl.get_backend(other_backend)
    try:
        bk.device(device)
    except ValueError as exc:
        assert other_backend in str(exc) and device.split(":")[0] in str(exc).lower()
    else:  # the device exists here: arrays then land on it
        y = pl.asarray([1.0], backend=other_backend, device=device, dtype="float32")
        assert_close(y, np.ones(1), backend=other_backend, dtype="float32", device=device)


def test_arrays_stay_on_their_device():
    pytest.importorskip("array_api_strict")
    b = "array_api_strict"
    x = pl.asarray(random_array(0, (3, 8), "float32")[0], backend=b, device="device1")
    w = pl.asarray(np.ones(8, np.float32), backend=b, device="device1")
    out = pl.rms_norm(x, w)
    assert_close(out, pl.rms_norm(pl.to_numpy(x), np.ones(8, np.float32)), backend=b,
                 device="device1")  # fmt: skip
    for op in (pl.silu, pl.gelu, pl.softmax, pl.relu):
        assert pl.device_of(op(x)) == pl.device_of(x)
    assert pl.device_of(pl.mlp(x, pl.asarray(np.ones((4, 8), np.float32), backend=b,
                        device="device1"), pl.asarray(np.ones((4, 8), np.float32), backend=b,
                        device="device1"), pl.asarray(np.ones((8, 4), np.float32), backend=b,
                        device="device1"))) == pl.device_of(x)  # fmt: skip
    # Moving back to the CPU device is explicit.
    y = pl.asarray(x, device="cpu")
    assert pl.device_of(y) == pl.get_backend(b).device("cpu")


def test_converted_inputs_join_the_device_of_the_calls_arrays():
    """backend= converts a foreign (NumPy) weight onto x's device, not the default device."""
    pytest.importorskip("array_api_strict")
    b = "array_api_strict"
    x_host = random_array(0, (3, 8), "float32")[0]
    w_host = np.linspace(0.5, 1.5, 8, dtype=np.float32)
    x = pl.asarray(x_host, backend=b, device="device1")
    out = pl.rms_norm(x, w_host, backend=b)
    assert_close(out, reference.rms_norm(x_host, w_host, 1e-5), backend=b, dtype="float32",
                 device="device1")  # fmt: skip
    # The weight first: the device still comes from the call's own array, wherever it stands.
    y = pl.linear(x_host, pl.asarray(np.ones((4, 8), np.float32), backend=b, device="device1"),
                  backend=b)  # fmt: skip
    assert pl.device_of(y) == pl.get_backend(b).device("device1")
    assert_close(y, x_host.astype(np.float64) @ np.ones((8, 4)), backend=b, dtype="float32",
                 device="device1")  # fmt: skip
    # With no array of the backend in the call, its default device.
    z = pl.silu(x_host, backend=b)
    assert pl.device_of(z) == pl.device_of(pl.asarray([0.0], backend=b))


def test_impl_selection(backend):
    x = pl.asarray([[0.5, -1.0, 2.0]], backend=backend, dtype="float32")
    w = pl.asarray([1.0, 2.0, 3.0], backend=backend, dtype="float32")
    portable = pl.rms_norm(x, w, impl="portable")
    assert_close(pl.rms_norm(x, w, impl="auto"), portable)
    if "rms_norm" in dispatcher(pl.get_backend(backend)).native:
        assert_close(pl.rms_norm(x, w, impl="native"), portable)
    else:
        with pytest.raises(ValueError, match=f"rms_norm: backend '{backend}' has no native"):
            pl.rms_norm(x, w, impl="native")
    with pytest.raises(ValueError, match="impl must be one of") as info:
        pl.rms_norm(x, w, impl="fast")
    for impl in IMPLS:
        assert impl in str(info.value)


def test_auto_choice_cached_by_dtype_follows_the_dtype(backend):
    # pick() caches a dtype-only choice per (op, dtype): alternating dtypes must still get
    # each dtype's own choice, the same as the uncached rule (Native.auto).
    from portable_llm.core.dispatch import dispatcher, pick

    bk = pl.get_backend(backend)
    nat = dispatcher(bk).native.get("rms_norm")
    for _ in range(2):
        for dtype in bk.float_dtypes():
            x = pl.asarray(np.ones((2, 8)), backend=backend, dtype=dtype)
            w = pl.asarray(np.ones(8), backend=backend, dtype=dtype)
            chosen = pick(bk, "rms_norm", "auto", x, w, eps=1e-5)
            if nat is not None and nat.auto(x, w, eps=1e-5):
                assert chosen is nat.fn, dtype
            else:
                assert chosen is dispatcher(bk).portable_impl("rms_norm", "portable"), dtype


def test_resolve_pair_matches_resolve(backend):
    from portable_llm.backends import resolve_pair

    x = pl.asarray(np.ones(3), backend=backend)
    bk, a, b = resolve_pair("op", None, x, x)
    assert (bk, (a, b)) == (resolve("op", None, x, x)[0], (x, x))
    with pytest.raises(TypeError, match="op: no array argument"):
        resolve_pair("op", None, 1.0, 2.0)
    if backend != "numpy":  # two libraries without backend=: the TypeError names both
        with pytest.raises(TypeError, match=f"numpy and {backend}|{backend} and numpy"):
            resolve_pair("op", None, np.ones(3), x)


def test_host_arrays_go_to_torchs_default_device():
    """NumPy input to torch lands on torch's default device (torch.set_default_device), as
    torch.asarray does, through DLPack or not; "meta" stands in for a GPU here."""
    torch = pytest.importorskip("torch")
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        for host in (np.ones((2, 3), np.float32), random_array(0, (2, 3), "bfloat16")[0]):
            assert pl.asarray(host, backend="torch").device.type == "meta"
        x = torch.ones(2, 3)  # created on the default device
        assert pl.rms_norm(x, np.ones(3, np.float32), backend="torch").device.type == "meta"
        assert pl.asarray(np.ones(3), backend="torch", device="cpu").device.type == "cpu"
    finally:
        torch.set_default_device(before)


def test_synchronize_returns_its_argument_computed(backend):
    bk = pl.get_backend(backend)
    x, xr = random_array(0, (3, 8), "float32", backend=backend)
    y = pl.silu(x)
    assert bk.synchronize(y) is y
    pair = (y, pl.relu(x))
    assert bk.synchronize(pair) is pair
    assert_close(y, reference.silu(xr), backend=backend, dtype="float32")
    # Lazy or asynchronous libraries need it; NumPy and array-api-strict never do; torch on
    # CUDA and MPS only.
    if backend == "torch":
        assert bk.asynchronous() is (bk.device(None).type in ("cuda", "mps"))
        assert bk.asynchronous("cpu") is False
    else:
        assert bk.asynchronous() is (backend in ("mlx", "jax"))


def test_enable_float64_makes_float64_available(backend):
    bk = pl.get_backend(backend)
    assert bk.enable_float64() is True  # every backend here has float64 on the CPU
    assert "float64" in bk.float_dtypes()
    y = pl.asarray(np.array([1.0 + 2.0**-40]), backend=backend, dtype="float64")
    assert pl.to_numpy(y).dtype == np.float64 and pl.to_numpy(y)[0] == 1.0 + 2.0**-40


def test_enable_float64_turns_on_jax_x64_in_a_fresh_process():
    pytest.importorskip("jax")
    code = (
        "import portable_llm as pl\n"
        "bk = pl.get_backend('jax')\n"
        "before = 'float64' in bk.float_dtypes()\n"
        "print(before, bk.enable_float64(), 'float64' in bk.float_dtypes())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True"]


def test_a_variant_without_a_kernel_of_its_own_takes_its_base_ops_choices(backend):
    """``model_linear`` (a model's products, ``variant`` of ``linear``): where the backend has
    no kernel of its own for it, every impl picks what ``linear``'s picks; where it has one
    (torch), ``auto`` and ``native`` take that one and ``portable`` stays ``linear``'s."""
    from portable_llm.core.dispatch import pick

    bk = pl.get_backend(backend)
    x, _ = random_array(0, (1, 8), "float32", backend=backend)
    w, _ = random_array(1, (3, 8), "float32", backend=backend)
    own = dispatcher(bk).native.get("model_linear")
    for impl in ("auto", "portable", "native"):
        if impl == "native" and own is None and "linear" not in dispatcher(bk).native:
            with pytest.raises(ValueError, match="no native kernel"):
                pick(bk, "model_linear", impl, x, w, None)
            continue
        got = pick(bk, "model_linear", impl, x, w, None)
        mine = own is not None and impl != "portable"
        assert got is (own.fn if mine else pick(bk, "linear", impl, x, w, None)), impl
