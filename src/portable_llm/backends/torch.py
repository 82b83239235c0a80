"""PyTorch: CPU, CUDA and MPS (MPS has no float64)."""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_llm.backends.base import FLOAT_DTYPES, Backend, numpy_bfloat16, seed_value


class TorchBackend(Backend):
    name = "torch"

    def __init__(self) -> None:
        super().__init__()
        import array_api_compat.torch as xp
        import torch

        self.torch = torch
        self.xp = xp
        self.version = torch.__version__
        self._set_dtypes(
            {
                "float16": torch.float16,
                "bfloat16": torch.bfloat16,
                "float32": torch.float32,
                "float64": torch.float64,
                "int32": torch.int32,
                "int64": torch.int64,
                "bool": torch.bool,
            }
        )

    def float_dtypes(self, device: Any = None) -> tuple[str, ...]:
        dev = self.device(device)
        if dev.type == "mps":
            return tuple(n for n in FLOAT_DTYPES if n != "float64")
        return FLOAT_DTYPES

    def device(self, spec: Any) -> Any:
        torch = self.torch
        if isinstance(spec, torch.device):
            return spec
        if spec is None:
            return torch.get_default_device()
        if spec == "gpu":
            if torch.cuda.is_available():
                return torch.device("cuda")
            if torch.backends.mps.is_available():
                return torch.device("mps")
            raise ValueError("backend 'torch' has no GPU here (neither CUDA nor MPS is available)")
        try:
            dev = torch.device(spec)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"backend 'torch' has no device {spec!r}: {exc}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"backend 'torch': device {spec!r} asked for but CUDA is not available"
            )
        if dev.type == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"backend 'torch': device {spec!r} asked for but MPS is not available")
        return dev

    def device_of(self, x: Any) -> Any:
        return x.device

    def asynchronous(self, device: Any = None) -> bool:
        return bool(self.device(device).type in ("cuda", "mps"))

    def synchronize(self, x: Any) -> Any:
        # CUDA and MPS kernels run asynchronously; CPU ones have finished on return.
        for dev in {t.device for t in (x if isinstance(x, tuple | list) else (x,))}:
            if dev.type == "cuda":
                self.torch.cuda.synchronize(dev)
            elif dev.type == "mps":
                self.torch.mps.synchronize()
        return x

    def to_numpy(self, x: Any) -> np.ndarray:
        x = x.detach()
        if x.dtype == self.torch.bfloat16:
            bf16 = numpy_bfloat16()
            raw = x.cpu().view(self.torch.int16).numpy()
            return raw.view(bf16) if bf16 is not None else x.cpu().float().numpy()
        return x.cpu().numpy()

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        torch = self.torch
        if a.dtype == numpy_bfloat16():
            t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(a))
        # device=None: torch's default device (torch.set_default_device), like torch.asarray.
        return t.to(self.device(device))

    def from_dlpack(self, x: Any) -> Any:
        return self.torch.from_dlpack(x)

    def to_device(self, x: Any, device: Any) -> Any:
        return x.to(self.device(device))

    def astype(self, x: Any, dtype: Any) -> Any:
        return x.to(dtype)

    def rng(self, key: Any, like: Any = None) -> Any:
        # None: torch's default generator (torch.manual_seed); an int: a fresh torch.Generator
        # on like's device.
        torch = self.torch
        if key is None or isinstance(key, torch.Generator):
            return key
        seed = seed_value(key, "a torch.Generator")
        gen = torch.Generator(device=like.device if like is not None else "cpu")
        return gen.manual_seed(seed)

    def uniform(self, rng: Any, shape: tuple[int, ...], like: Any) -> Any:
        torch = self.torch
        dev = like.device if rng is None else rng.device
        u = torch.rand(shape, generator=rng, dtype=torch.float32, device=dev)
        return u if u.device == like.device else u.to(like.device)


def load() -> Backend:
    return TorchBackend()
