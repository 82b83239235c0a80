"""``portable-llm report`` runs the kernels a loaded model binds once (packed and specialized
projections), so it fails where a model would, not only where a public op would."""

from __future__ import annotations

import pytest

from conftest import only_on
from portable_llm.backends import get_backend
from portable_llm.cli.cli import main
from portable_llm.core.dispatch import dispatcher


@only_on("torch")
def test_report_fails_where_the_bound_packing_fails(monkeypatch, capsys):
    """A packing kernel that raises (as oneDNN's bfloat16 reorder did on an AVX2-only CPU)
    turns the report's bound row into ERROR and its exit code into 1; the op rows, which never
    pack, stay ok."""
    nat = dispatcher(get_backend("torch")).native["pack_linear"]

    def unsupported(xp, w):
        raise RuntimeError("bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(nat, "fn", unsupported)
    monkeypatch.setattr(nat, "applies", lambda w: True)
    code = main(["report", "--backend", "torch", "--dtype", "bfloat16", "--op", "linear"])
    out = capsys.readouterr().out
    assert code == 1, out
    bound = [line for line in out.splitlines() if line.startswith("bound linear")]
    plain = [line for line in out.splitlines() if line.startswith("linear ")]
    assert bound and "ERROR" in bound[0] and "avx512bw" in out, out
    assert plain and all(line.rstrip().endswith("ok") for line in plain), out


@only_on("torch")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_report_runs_the_packed_kernel_where_a_model_packs(capsys, dtype):
    """Where the dispatcher packs a weight (torch's CPU in bfloat16, where the CPU runs it),
    the bound row's path is the packed product's kernel; elsewhere the plain F.linear."""
    d = dispatcher(get_backend("torch"))
    import torch

    w = torch.zeros(8, 8, dtype=getattr(torch, dtype))
    packs = d.pick("pack_linear", "auto", w) is not d.portable_impl("pack_linear")
    assert main(["report", "-v", "--backend", "torch", "--dtype", dtype, "--op", "linear"]) == 0
    out = capsys.readouterr().out
    ran = [line.strip() for line in out.splitlines() if line.strip().startswith("bound linear")]
    assert ran, out
    assert any("_linear_pointwise" in line for line in ran) is packs, out
