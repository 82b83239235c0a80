"""array-api-strict: the standard and nothing more (float32 and float64 only).

Its extra devices (``"device1"``, ``"device2"``) need no GPU: tests use them to check that arrays
stay on the device they came from.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_llm.backends.base import Backend


class StrictBackend(Backend):
    name = "array_api_strict"

    def __init__(self) -> None:
        super().__init__()
        import array_api_strict as xp

        self.xp = xp
        self.version = xp.__version__
        self._set_dtypes(
            {
                "float32": xp.float32,
                "float64": xp.float64,
                "int32": xp.int32,
                "int64": xp.int64,
                "bool": xp.bool,
            }
        )

    def device(self, spec: Any) -> Any:
        xp = self.xp
        if spec is None:
            return None
        if isinstance(spec, xp.Device):
            return spec
        name = {"cpu": "CPU_DEVICE"}.get(spec, spec)
        try:
            return xp.Device(name)
        except ValueError:
            raise ValueError(
                f"backend 'array_api_strict' has no device {spec!r}; "
                "use 'cpu', 'device1' or 'device2'"
            ) from None

    def device_of(self, x: Any) -> Any:
        return x.device

    def to_numpy(self, x: Any) -> np.ndarray:
        if x.device != self.xp.Device("CPU_DEVICE"):
            x = self.xp.asarray(x, device=self.xp.Device("CPU_DEVICE"))
        return np.asarray(x)

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        return self.xp.asarray(a, device=self.device(device))

    def from_dlpack(self, x: Any) -> Any:
        raise NotImplementedError  # go through NumPy: strict validates dtypes there

    def to_device(self, x: Any, device: Any) -> Any:
        return x.to_device(self.device(device))


def load() -> Backend:
    return StrictBackend()
