"""MXFP4 against transformers' own gpt-oss reader (``convert_moe_packed_tensors``, what
``from_pretrained`` runs on a gpt-oss checkpoint's ``*_blocks``/``*_scales`` without a GPU
kernel): the same weights, exactly, in float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.checkpoint.mxfp4 import mxfp4_from_blocks
from portable_llm.testing import assert_close

pytestmark = pytest.mark.oracle

torch = pytest.importorskip("torch")
mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_equals_transformers_gpt_oss_reader(backend, dtype):
    if dtype not in pl.get_backend(backend).float_dtypes():
        pytest.skip(f"{backend} has no {dtype}")
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)  # (X, N, K / 32, 16)
    scales = rng.integers(115, 140, (3, 10, 4), dtype=np.uint8)
    hf = mxfp4.convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=getattr(torch, dtype)
    )  # (X, K, N): transformers transposes to its (in, out) parameter layout
    want = hf.transpose(1, 2).float().numpy()  # (X, N, K)
    qw = mxfp4_from_blocks(blocks, scales, dtype=dtype, backend=backend)
    assert_close(pl.dequantize(qw), want, rtol=0, atol=0, backend=backend, dtype=dtype)
    assert_close(pl.dequantize(qw[1]), want[1], rtol=0, atol=0, backend=backend, dtype=dtype)
