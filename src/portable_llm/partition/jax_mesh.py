"""JAX: one process drives a mesh; weights are placed with ``NamedSharding`` and XLA inserts
the collectives (GSPMD).

``tensor_parallel``: a ``jax.sharding.Mesh`` with one axis (any name), or ``(mesh, axis_name)``;
``pipeline_parallel``: the same for the stages; both at once: one 2-D mesh with axes ``"pp"``
and ``"tp"`` passed to both keywords. Each stage's weights live on its row of the mesh, split
over the ``tp`` devices along the axes of :meth:`~portable_llm.partition.plan.PartitionPlan.
split_axis`; the hidden states go from stage to stage with ``jax.device_put`` (a device-to-device
copy), and the all-reduces of tensor parallelism are XLA's own, inserted where a row-split
product meets a replicated output.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_llm.partition.engine import Engine, QuantizedSlice, Reader
from portable_llm.partition.plan import PartitionPlan

__all__ = ["JaxEngine", "launch_groups", "make_engine"]


def _axis(handle: Any, keyword: str, want: str) -> tuple[Any, str]:
    """``(mesh, axis name)`` of a handle: a 1-axis mesh, ``(mesh, name)``, or a 2-D mesh with
    the axis ``want``; ``ValueError`` naming the axis it lacks."""
    from jax.sharding import Mesh

    if isinstance(handle, tuple) and len(handle) == 2 and isinstance(handle[0], Mesh):
        mesh, name = handle
    elif isinstance(handle, Mesh):
        mesh = handle
        name = mesh.axis_names[0] if len(mesh.axis_names) == 1 else want
    else:
        raise ValueError(
            f"load: {keyword} on JAX must be a jax.sharding.Mesh or (mesh, axis_name), got "
            f"{type(handle).__name__}"
        )
    if name not in mesh.axis_names:
        raise ValueError(
            f"load: {keyword}: the mesh has no axis {name!r} (its axes: {mesh.axis_names}; a "
            "2-D mesh needs axes named 'pp' and 'tp')"
        )
    return mesh, name


class JaxEngine(Engine):
    """The stages of a mesh: ``self.meshes[s]`` is stage ``s``'s 1-axis mesh of TP devices."""

    pp_rank = None

    def __init__(self, tensor_parallel: Any, pipeline_parallel: Any) -> None:
        from jax.sharding import Mesh

        # None: not split that way; any other value is a handle, checked (0, False, () too)
        tp = None if tensor_parallel is None else _axis(tensor_parallel, "tensor_parallel", "tp")
        pp = (
            None
            if pipeline_parallel is None
            else _axis(pipeline_parallel, "pipeline_parallel", "pp")
        )
        if tp is None and pp is None:
            raise ValueError("load: give tensor_parallel or pipeline_parallel (a JAX mesh)")
        if tp and pp and tp[0] is not pp[0]:
            raise ValueError(
                "load: tensor_parallel and pipeline_parallel on JAX must be one 2-D mesh (axes "
                "'pp' and 'tp') passed to both"
            )
        if tp and pp and tp[1] == pp[1]:
            raise ValueError(
                f"load: tensor_parallel and pipeline_parallel on JAX both name the mesh axis "
                f"{tp[1]!r} (its axes: {tp[0].axis_names}); one axis cannot split both ways: "
                "pass one 2-D mesh with axes 'pp' and 'tp' to both, or one keyword"
            )
        mesh = (tp or pp)[0]  # type: ignore[index]
        devices = np.asarray(mesh.devices)
        names = list(mesh.axis_names)
        tp_name = tp[1] if tp else None
        pp_name = pp[1] if pp else None
        others = [n for n in names if n not in (tp_name, pp_name)]
        if any(mesh.shape[n] != 1 for n in others):
            raise ValueError(
                f"load: the mesh's axes {others} are neither tensor_parallel's nor "
                "pipeline_parallel's"
            )
        order = [n for n in (pp_name, tp_name) if n] + others
        devices = devices.transpose([names.index(n) for n in order])
        devices = devices.reshape(mesh.shape[pp_name] if pp_name else 1, -1)  # (P, T)
        self.axis = tp_name or "tp"
        self.meshes = [Mesh(row, (self.axis,)) for row in devices]
        self.pp_size, self.tp_size = devices.shape

    def sharding(self, stage: int, spec: tuple[str | None, ...] = ()) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.meshes[stage], PartitionSpec(*spec))

    def place(self, name: str, shape: tuple[int, ...], plan: PartitionPlan, read: Reader) -> Any:
        import jax

        axis = plan.split_axis(name, len(shape))
        spec = tuple(self.axis if d == axis else None for d in range(len(shape)))
        seen: dict[Any, Any] = {}  # an array, or a QuantizedSlice

        def shard(index: tuple[slice, ...] | None) -> Any:
            index = index or ()
            key = tuple((s.start, s.stop) for s in index)
            if key not in seen:  # a replicated tensor is read once, not once per device
                seen[key] = read(name, index)
            return seen[key]

        sharding = self.sharding(plan.pp_rank, spec)
        first = shard(next(iter(sharding.devices_indices_map(shape).values())))
        if isinstance(first, QuantizedSlice):  # three arrays, split along the same axis
            return self._place_quantized(shape, sharding, shard, first)
        return jax.make_array_from_callback(shape, sharding, shard)

    @staticmethod
    def _place_quantized(shape: tuple[int, ...], sharding: Any, shard: Any, q: Any) -> Any:
        """A quantized weight of (dequantized) ``shape`` placed with ``sharding``: each
        device's codes, scales and biases are those of its slice of the weight (whole
        groups), so the three arrays are split along the weight's axis."""
        import jax

        from portable_llm.ops.quant import QuantizedWeight

        pieces: list[list[Any]] = [[], [], []]
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            for part, host in zip(pieces, shard(index)[:3], strict=True):
                part.append(jax.device_put(host, device))
        lead, K = shape[:-1], shape[-1]
        shapes = [(*lead, K * q.bits // 32), *[(*lead, K // q.group_size)] * 2]
        arrays = [
            jax.make_array_from_single_device_arrays(s, sharding, part)
            for s, part in zip(shapes, pieces, strict=True)
        ]
        return QuantizedWeight(*arrays, bits=q.bits, group_size=q.group_size)

    def move(self, h: Any, stage: int) -> Any:
        import jax

        target = self.sharding(stage)
        if h.is_fully_addressable or not h.sharding.is_fully_replicated:
            return jax.device_put(h, target)
        # Over several processes (jax.distributed), JAX's CPU and GPU runtimes reshard only
        # within one set of devices: each process copies its own replica of ``h`` onto its
        # devices of the next stage (a process that holds a device of stage s + 1 holds one
        # of stage s too: ``launch_groups``' and the tests' meshes).
        local = h.addressable_data(0)
        devices = target.addressable_devices_indices_map(h.shape)
        pieces = [jax.device_put(local, d) for d in devices]
        return jax.make_array_from_single_device_arrays(h.shape, target, pieces)


def make_engine(tensor_parallel: Any, pipeline_parallel: Any) -> JaxEngine:
    return JaxEngine(tensor_parallel, pipeline_parallel)


def launch_groups(tp: int, pp: int) -> tuple[dict[str, Any], bool]:
    """A mesh over the first ``tp * pp`` of ``jax.devices()`` (axes ``"pp"`` and ``"tp"`` when
    both are > 1). Returns the keywords of :func:`portable_llm.load` and ``True`` (one
    process drives them all)."""
    import jax
    from jax.sharding import Mesh

    devices = jax.devices()
    if len(devices) < tp * pp:
        raise ValueError(
            f"--tensor-parallel {tp} x --pipeline-parallel {pp} needs {tp * pp} JAX devices; "
            f"there are {len(devices)} (on a CPU: XLA_FLAGS="
            f"--xla_force_host_platform_device_count={tp * pp})"
        )
    mesh = Mesh(np.asarray(devices[: tp * pp]).reshape(pp, tp), ("pp", "tp"))
    out: dict[str, Any] = {}
    if tp > 1:
        out["tensor_parallel"] = mesh if pp > 1 else (mesh, "tp")
    if pp > 1:
        out["pipeline_parallel"] = mesh if tp > 1 else (mesh, "pp")
    return out, True
