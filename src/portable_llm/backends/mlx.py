"""MLX: CPU (Linux and macOS), Metal GPU (macOS), CUDA. No float64 on the GPU."""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_llm.backends.base import FLOAT_DTYPES, Backend, numpy_bfloat16, seed_value


class MlxBackend(Backend):
    name = "mlx"

    def __init__(self) -> None:
        super().__init__()
        import mlx.core as mx

        from portable_llm.backends.mlx_compat import make_namespace

        self.mx = mx
        self.xp = make_namespace(mx)
        self.version = str(getattr(mx, "__version__", "unknown"))
        self._set_dtypes(
            {
                "float16": mx.float16,
                "bfloat16": mx.bfloat16,
                "float32": mx.float32,
                "float64": mx.float64,
                "int32": mx.int32,
                "int64": mx.int64,
                "bool": mx.bool_,
            }
        )

    def float_dtypes(self, device: Any = None) -> tuple[str, ...]:
        if self._is_gpu(device):
            return tuple(n for n in FLOAT_DTYPES if n != "float64")
        return FLOAT_DTYPES

    def _is_gpu(self, spec: Any) -> bool:
        """Whether ``spec`` names MLX's GPU (without asking whether one is present)."""
        mx = self.mx
        if spec is None:
            return bool(mx.default_device().type == mx.gpu)
        if isinstance(spec, mx.Device):
            return bool(spec.type == mx.gpu)
        if isinstance(spec, str):
            return spec in ("gpu", "mps", "metal") or spec.startswith("cuda")
        return bool(spec == mx.gpu)

    def device(self, spec: Any) -> Any:
        mx = self.mx
        if spec is None:
            return mx.default_device()
        if isinstance(spec, mx.Device):
            return spec
        if spec == "cpu" or spec == mx.cpu:
            return mx.Device(mx.cpu)
        if self._is_gpu(spec):
            if not mx.is_available(mx.gpu):
                raise ValueError(f"backend 'mlx' has no GPU here (device {spec!r} asked for)")
            return mx.Device(mx.gpu)
        raise ValueError(f"backend 'mlx' has no device {spec!r}; use 'cpu' or 'gpu'")

    def synchronize(self, x: Any) -> Any:
        self.mx.eval(x)  # MLX is lazy: this computes x (and every array it depends on)
        return x

    def launch(self, x: Any) -> None:
        self.mx.async_eval(x)

    def asynchronous(self, device: Any = None) -> bool:
        return True  # lazy: nothing is computed until evaluated

    def pipelines(self, device: Any = None) -> bool:
        # On the CPU mx.async_eval runs most of the work before it returns: queuing ahead made
        # a tiny model's decode slower there (compiled step 994 -> 686 tok/s; see
        # benchmarks/README.md). On a GPU the host is free while the step runs.
        return self._is_gpu(device)

    def device_of(self, x: Any) -> Any:
        # MLX arrays live in unified memory; work runs on the default device.
        return self.mx.default_device()

    def to_numpy(self, x: Any) -> np.ndarray:
        if x.dtype == self.mx.bfloat16:
            bf16 = numpy_bfloat16()
            raw = np.array(x.view(self.mx.int16))
            return raw.view(bf16) if bf16 is not None else np.array(x.astype(self.mx.float32))
        return np.array(x)

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        self.device(device)
        mx = self.mx
        if a.dtype == numpy_bfloat16():
            return mx.array(np.ascontiguousarray(a).view(np.int16)).view(mx.bfloat16)
        # mx.array turns float64 into float32 unless told the dtype.
        return mx.array(a, dtype=self.dtypes.get(a.dtype.name))

    def from_dlpack(self, x: Any) -> Any:
        # mx.array(obj) reads the buffer protocol / __array__ of host arrays; let the NumPy
        # path handle everything so bfloat16 and devices are treated in one place.
        raise NotImplementedError

    def to_device(self, x: Any, device: Any) -> Any:
        self.device(device)  # validates; MLX arrays have no device to move between
        return x

    def rng(self, key: Any, like: Any = None) -> Any:
        # None: MLX's global key (mx.random.seed); an int: mx.random.key(seed); a key as is.
        mx = self.mx
        if key is None or isinstance(key, mx.array):
            return key
        return mx.random.key(seed_value(key, "an mx.random.key"))

    def uniform(self, rng: Any, shape: tuple[int, ...], like: Any) -> Any:
        mx = self.mx
        return mx.random.uniform(shape=shape, dtype=mx.float32, key=rng)


def load() -> Backend:
    return MlxBackend()
