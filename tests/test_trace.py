"""``pl.trace()``: what the dispatcher records, per public call, on every backend."""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.core import dispatch
from portable_llm.core.dispatch import TraceEntry, dispatcher
from portable_llm.testing import assert_close, random_array, random_weight, reference

SDPA = "scaled_dot_product_attention"


def _x_w(backend: str, dtype: str = "float32") -> tuple[tuple, tuple]:
    x = random_array(0, (2, 3, 16), dtype, backend=backend)
    w = random_array(1, (16,), dtype, backend=backend, low=0.5, high=1.5)
    return x, w


def _expected(bk: pl.backends.Backend, op: str, *args, **options) -> tuple[str, str]:
    """(impl, kernel) that auto must record, from the dispatcher's own tables."""
    nat = dispatcher(bk).native.get(op)
    if nat is not None and nat.auto(*args, **options):
        return "native", nat.kernel
    fn = dispatcher(bk).portable_impl(op)
    return "portable", dispatcher(bk).label(fn)[1]


def test_entries_have_op_backend_impl_and_kernel(backend):
    bk = pl.get_backend(backend)
    (x, xr), (w, wr) = _x_w(backend)
    with pl.trace() as t:
        out = pl.rms_norm(x, w, eps=1e-6)
    assert_close(out, reference.rms_norm(xr, wr, 1e-6), backend=backend, dtype="float32")
    assert len(t) == 1
    entry = t[0]
    assert isinstance(entry, TraceEntry) and entry._fields == ("op", "backend", "impl", "kernel")
    assert (entry.op, entry.backend) == ("rms_norm", backend)
    assert (entry.impl, entry.kernel) == _expected(bk, "rms_norm", x, w, eps=1e-6)
    assert t.ops("rms_norm") == [entry] and t.ops("silu") == []


@pytest.mark.parametrize("op", ["rms_norm", "silu", "softmax", "linear"])
def test_impl_portable_records_portable(backend, op):
    (x, _), (w, _) = _x_w(backend)
    calls = {
        "rms_norm": lambda: pl.rms_norm(x, w, impl="portable"),
        "silu": lambda: pl.silu(x, impl="portable"),
        "softmax": lambda: pl.softmax(x, impl="portable"),
        "linear": lambda: pl.linear(
            x, random_weight(2, (8, 16), "float32", backend=backend)[0], impl="portable"
        ),
    }
    with pl.trace() as t:
        calls[op]()
    assert [(e.op, e.backend, e.impl) for e in t] == [(op, backend, "portable")]
    # The kernel of a portable entry is the portable function's qualified name.
    assert t[0].kernel.startswith("portable_llm.") and op in t[0].kernel


def test_impl_native_records_the_kernel(backend):
    bk = pl.get_backend(backend)
    (x, _), _ = _x_w(backend)
    nat = dispatcher(bk).native.get("linear")
    if nat is None:
        pytest.skip(f"{backend} has no native linear")
    with pl.trace() as t:
        pl.linear(x, random_weight(2, (8, 16), "float32", backend=backend)[0], impl="native")
    assert t == [TraceEntry("linear", backend, "native", nat.kernel)]


def test_torch_sdpa_auto_records_the_torch_kernel():
    pytest.importorskip("torch")
    q, qr = random_array(0, (1, 4, 6, 16), "float32", backend="torch")
    k, kr = random_array(1, (1, 2, 6, 16), "float32", backend="torch")
    v, vr = random_array(2, (1, 2, 6, 16), "float32", backend="torch")
    with pl.trace() as t:
        out = pl.scaled_dot_product_attention(q, k, v, mask="causal")
    assert t == [
        TraceEntry(SDPA, "torch", "native", "torch.nn.functional.scaled_dot_product_attention")
    ]
    want = reference.scaled_dot_product_attention(qr, kr, vr, mask="causal")
    assert_close(out, want, backend="torch", dtype="float32")


def test_long_sequence_records_tiled_where_auto_picks_it(backend):
    # L * S = 2**20 scores: past TILED_MIN_SCORES. softcap has no native kernel on any backend,
    # so auto falls back to the portable side, and there chooses the tiled path.
    q, qr = random_array(0, (1, 1, 1024, 8), "float32", backend=backend)
    k, kr = random_array(1, (1, 1, 1024, 8), "float32", backend=backend)
    v, vr = random_array(2, (1, 1, 1024, 8), "float32", backend=backend)
    with pl.trace() as t:
        out = pl.scaled_dot_product_attention(q, k, v, mask="causal", softcap=5.0)
    top = t.ops(SDPA)
    assert len(top) == 1 and top[0].impl == "tiled" and top[0].backend == backend
    # The tiled path's own pieces follow, under the op's name with a suffix.
    assert {e.op for e in t} - {SDPA} <= {f"{SDPA}.tiled"}
    want = reference.scaled_dot_product_attention(qr, kr, vr, mask="causal", softcap=5.0)
    assert_close(out, want, backend=backend, dtype="float32")
    # A short sequence with the same options stays on the direct portable path.
    with pl.trace() as short:
        pl.scaled_dot_product_attention(q[..., :8, :], k[..., :8, :], v[..., :8, :],
                                        mask="causal", softcap=5.0)  # fmt: skip
    assert [e.impl for e in short.ops(SDPA)] == ["portable"]


def test_long_sequence_without_native_kernel_records_tiled(backend):
    bk = pl.get_backend(backend)
    if SDPA in dispatcher(bk).native:
        pytest.skip(f"{backend} has a native SDPA kernel; auto takes it for plain causal")
    q, _ = random_array(0, (1, 1, 1024, 8), "float32", backend=backend)
    with pl.trace() as t:
        pl.scaled_dot_product_attention(q, q, q, mask="causal")
    assert [e.impl for e in t.ops(SDPA)] == ["tiled"]


def test_nested_traces_each_see_the_calls_made_while_open(backend):
    (x, _), (w, _) = _x_w(backend)
    with pl.trace() as outer:
        pl.silu(x)
        with pl.trace() as inner:
            pl.rms_norm(x, w)
        pl.relu(x)
    assert [e.op for e in outer] == ["silu", "rms_norm", "relu"]
    assert [e.op for e in inner] == ["rms_norm"]
    assert inner[0] == outer[1]


def test_composite_ops_record_their_inner_ops(backend):
    e, i = 16, 24
    (x, xr), _ = _x_w(backend)
    wg, wgr = random_weight(3, (i, e), "float32", backend=backend)
    wu, wur = random_weight(4, (i, e), "float32", backend=backend)
    wd, wdr = random_weight(5, (e, i), "float32", backend=backend)
    with pl.trace() as t:
        out = pl.mlp(x, wg, wu, wd)
    assert_close(out, reference.mlp(xr, wgr, wur, wdr), backend=backend, dtype="float32")
    assert sorted({en.op for en in t}) == ["linear", "silu"]
    assert all(en.backend == backend for en in t)
    bk = pl.get_backend(backend)
    assert t.ops("linear")[0][2:] == _expected(bk, "linear", x, wg, None)

    h, h_kv, d = 4, 2, 4
    shapes = [(h * d, e), (h_kv * d, e), (h_kv * d, e), (e, h * d)]
    ws = [random_weight(6 + j, s, "float32", backend=backend) for j, s in enumerate(shapes)]
    qn, qnr = random_array(11, (d,), "float32", backend=backend, low=0.5, high=1.5)
    with pl.trace() as t:
        out = pl.attention(x, wq=ws[0][0], wk=ws[1][0], wv=ws[2][0], wo=ws[3][0], q_norm=qn,
                           k_norm=qn, num_heads=h, num_kv_heads=h_kv,
                           rope={"base": 1e4})  # fmt: skip
    want = reference.attention(xr, *(r for _, r in ws), h, h_kv, q_norm=qnr, k_norm=qnr,
                               rope_options={"base": 1e4})  # fmt: skip
    assert_close(out, want, backend=backend, dtype="float32")
    ops = [en.op for en in t if "." not in en.op]
    # one entry per kernel run: the q/k/v projections, q and k norms, RoPE on q and k, SDPA,
    # the output projection
    assert ops == ["linear"] * 3 + ["rms_norm", "rms_norm", "rope", "rope", SDPA, "linear"]


def test_tracing_off_records_nothing(backend):
    (x, _), (w, _) = _x_w(backend)
    with pl.trace() as t:
        pass
    pl.rms_norm(x, w)  # after the block: not recorded anywhere
    pl.silu(x)
    assert t == [] and dispatch._OPEN.traces == []
    with pl.trace() as again:
        assert again == []  # nothing from before the block either
        pl.silu(x)
    assert [e.op for e in again] == ["silu"]


def test_a_trace_closes_when_its_block_raises(backend):
    (x, _), (w, _) = _x_w(backend)
    with pytest.raises(ValueError, match="rms_norm"), pl.trace() as t:
        pl.rms_norm(x, w[:3])
    assert dispatch._OPEN.traces == []
    pl.silu(x)
    assert [e.op for e in t] == []  # the failed call never reached the dispatcher


def test_trace_entries_compare_as_tuples():
    with pl.trace() as t:
        pl.silu(np.ones(3, np.float32))
    assert t[0] == ("silu", "numpy", "portable", t[0].kernel)
    assert t[0]._asdict()["impl"] == "portable"
