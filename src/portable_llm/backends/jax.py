"""JAX: CPU, GPU, TPU. float64 only when ``jax_enable_x64`` is set."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from portable_llm.backends.base import FLOAT_DTYPES, Backend, seed_value


class JaxBackend(Backend):
    name = "jax"
    static_shapes = True

    def __init__(self) -> None:
        super().__init__()
        import jax
        import jax.numpy as jnp

        self.jax = jax
        self.xp = jnp
        self._update_slice: Any = None
        self.version = jax.__version__
        self._set_dtypes(
            {
                "float16": np.dtype(jnp.float16),
                "bfloat16": np.dtype(jnp.bfloat16),
                "float32": np.dtype(jnp.float32),
                "float64": np.dtype(jnp.float64),
                "int32": np.dtype(jnp.int32),
                "int64": np.dtype(jnp.int64),
                "bool": np.dtype(jnp.bool_),
            }
        )

    def float_dtypes(self, device: Any = None) -> tuple[str, ...]:
        if self.jax.config.read("jax_enable_x64"):
            return FLOAT_DTYPES
        return tuple(n for n in FLOAT_DTYPES if n != "float64")

    def compile(self, fn: Any) -> Any:
        # One XLA computation per op, shape and option set, instead of one dispatch (and, on
        # first use of a shape, one compilation) per primitive in eager mode. Keyword-only
        # options are static; the namespace argument is too.
        static = [
            name
            for name, p in inspect.signature(fn).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        ]
        return self.jax.jit(fn, static_argnums=(0,), static_argnames=static)

    def synchronize(self, x: Any) -> Any:
        return self.jax.block_until_ready(x)

    def asynchronous(self, device: Any = None) -> bool:
        return True  # dispatch is asynchronous on every JAX device

    def enable_float64(self) -> bool:
        # Process-wide: arrays made before keep their dtypes; float64 inputs stay float64 after.
        self.jax.config.update("jax_enable_x64", True)
        return True

    def set_slice(self, buf: Any, start: tuple[int, ...], value: Any) -> Any:
        # JAX arrays are immutable: lax.dynamic_update_slice, jitted once per shape with the
        # start traced, and with buf donated so XLA writes into buf's memory instead of copying
        # it (O(value.size), not O(buf.size)). buf is invalid afterwards: use the result.
        if self._update_slice is None:
            jax = self.jax
            self._update_slice = jax.jit(jax.lax.dynamic_update_slice, donate_argnums=0)
        return self._update_slice(buf, value, tuple(start))

    def device(self, spec: Any) -> Any:
        jax = self.jax
        if spec is None:
            return jax.devices()[0]
        if not isinstance(spec, str):
            return spec
        kind, _, index = spec.partition(":")
        kind = {"cuda": "gpu", "rocm": "gpu"}.get(kind, kind)
        try:
            devices = jax.devices(kind)
        except RuntimeError:
            raise ValueError(f"backend 'jax' has no device {spec!r} here") from None
        i = int(index or 0)
        if i >= len(devices):
            raise ValueError(f"backend 'jax' has {len(devices)} {kind} device(s); got {spec!r}")
        return devices[i]

    def device_of(self, x: Any) -> Any:
        """The array's device; ``None`` (the default placement) for a tracer of ``jax.jit`` or
        ``jax.grad``, which has no device while it is traced; for an array over several
        devices, its mesh as a replicated ``NamedSharding``."""
        if isinstance(x, self.jax.core.Tracer):
            return None
        devices = x.devices()
        if len(devices) == 1:
            return next(iter(devices))
        # An array over several devices (a partitioned model's): its mesh, replicated, where
        # the inputs and the caches of the same computation go.
        from jax.sharding import NamedSharding, PartitionSpec

        mesh = getattr(x.sharding, "mesh", None)
        return x.sharding if mesh is None else NamedSharding(mesh, PartitionSpec())

    def split_heads(self, device: Any, shape: tuple[int, ...], axis: int) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec

        if not isinstance(device, NamedSharding) or not device.is_fully_replicated:
            return device
        (name, *more) = device.mesh.axis_names
        if more or shape[axis] % device.mesh.shape[name]:
            return device  # fewer heads than devices: every device holds every head
        spec = [None] * len(shape)
        spec[axis] = name
        return NamedSharding(device.mesh, PartitionSpec(*spec))  # (.., H_kv / T on each, ..)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def from_numpy(self, a: np.ndarray, device: Any = None) -> Any:
        arr = self.xp.asarray(a)
        return self.jax.device_put(arr, self.device(device)) if device is not None else arr

    def from_dlpack(self, x: Any) -> Any:
        return self.xp.from_dlpack(x)

    def to_device(self, x: Any, device: Any) -> Any:
        target = self.device(device)
        if not getattr(target, "is_fully_addressable", True):
            # A mesh over several processes (jax.distributed): JAX's CPU and GPU runtimes move
            # no array to another process's devices, so each process places its own copy of
            # the value from the host (the same ids on every process, as the replicated logits
            # give them).
            if x.is_fully_addressable:
                x = np.asarray(x)
            elif x.sharding.is_fully_replicated and x.sharding.device_set != target.device_set:
                x = np.asarray(x.addressable_data(0))
        return self.jax.device_put(x, target)

    def rng(self, key: Any, like: Any = None) -> Any:
        # JAX has no global random state: a draw needs a key (typed or a legacy uint32 PRNGKey).
        jax = self.jax
        if key is None:
            raise ValueError(
                "JAX has no global random state: pass key= (an int seed or a jax.random.key)"
            )
        if isinstance(key, jax.Array):
            return key
        return jax.random.key(seed_value(key, "a jax.random.key"))

    def uniform(self, rng: Any, shape: tuple[int, ...], like: Any) -> Any:
        jnp = self.xp
        return self.jax.random.uniform(rng, shape, dtype=jnp.float32)

    def is_traced(self, x: Any) -> bool:
        return isinstance(x, self.jax.core.Tracer)


def load() -> Backend:
    return JaxBackend()
