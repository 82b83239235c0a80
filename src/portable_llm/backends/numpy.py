"""NumPy: the float64 reference backend (bfloat16 through ml_dtypes when installed)."""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_llm.backends.base import Backend, numpy_bfloat16


class NumpyBackend(Backend):
    name = "numpy"

    def __init__(self) -> None:
        super().__init__()
        import array_api_compat.numpy as xp

        self.xp = xp
        self.version = np.__version__
        self._set_dtypes(
            {
                "float16": np.dtype(np.float16),
                "bfloat16": numpy_bfloat16(),
                "float32": np.dtype(np.float32),
                "float64": np.dtype(np.float64),
                "int32": np.dtype(np.int32),
                "int64": np.dtype(np.int64),
                "bool": np.dtype(np.bool_),
            }
        )

    def device(self, spec: Any) -> Any:
        if spec is None or spec == "cpu":
            return "cpu"
        return super().device(spec)

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        self.device(device)
        return a

    def from_dlpack(self, x: Any) -> Any:
        return np.from_dlpack(x)

    def to_device(self, x: Any, device: Any) -> Any:
        self.device(device)
        return x

    def astype(self, x: Any, dtype: Any) -> Any:
        return x.astype(dtype, copy=False)


def load() -> Backend:
    return NumpyBackend()
