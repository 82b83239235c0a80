"""The one NaN rule of ``quantize`` (issue 22): a weight holding NaN or an infinity is refused
on every backend and ``impl`` (MLX's kernel maps a NaN to a number while the portable formula
makes its whole group NaN, so neither can be the rule)."""

from __future__ import annotations

import numpy as np
import pytest

from portable_llm.backends import get_backend
from portable_llm.ops.quant import quantize


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("impl", ["auto", "portable"])
def test_non_finite_weight_is_refused(backend: str, impl: str, bad: float) -> None:
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    w[2, 17] = bad
    with pytest.raises(ValueError, match=r"quantize: w \(shape \(4, 64\)\) holds NaN or infinite"):
        quantize(get_backend(backend).from_numpy(w), bits=4, group_size=32, impl=impl)
