"""torch.distributed: one process per rank; ``all_reduce`` after ``o_proj`` and ``down_proj``,
``send``/``recv`` of the hidden states between stages, the logits broadcast from the last one,
rank 0's objects (:meth:`~portable_llm.partition.engine.Engine.broadcast_object`) with
``broadcast``.

``tensor_parallel`` / ``pipeline_parallel``: a ``torch.distributed`` process group (the default
group: ``torch.distributed.group.WORLD``) or a 1-D ``DeviceMesh`` (its group). Gloo on CPU,
NCCL on CUDA: the collectives are the group's own.
"""

from __future__ import annotations

import atexit
from typing import Any

import numpy as np

from portable_llm.partition.engine import Engine

__all__ = ["TorchEngine", "launch_groups", "make_engine"]


def _group(handle: Any, keyword: str) -> Any:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if handle is None:
        return None
    if isinstance(handle, DeviceMesh):
        if handle.ndim != 1:
            raise ValueError(
                f"load: {keyword} must be a 1-D DeviceMesh, got {handle.ndim} dimensions "
                f"{handle.mesh_dim_names}; pass one dimension (mesh['tp'])"
            )
        return handle.get_group()
    if not isinstance(handle, dist.ProcessGroup):
        raise ValueError(
            f"load: {keyword} on torch must be a torch.distributed ProcessGroup or a 1-D "
            f"DeviceMesh, got {type(handle).__name__}"
        )
    return handle


class TorchEngine(Engine):
    """The collectives of a ``torch.distributed`` TP group and PP group."""

    def __init__(self, tensor_parallel: Any, pipeline_parallel: Any) -> None:
        import torch.distributed as dist

        self.dist = dist
        tp = _group(tensor_parallel, "tensor_parallel")
        self.bind_groups(tp, _group(pipeline_parallel, "pipeline_parallel"))

    def all_reduce(self, x: Any) -> Any:
        if self.tp is None or self.tp_size == 1:
            return x
        x = x.contiguous()
        self.dist.all_reduce(x, group=self.tp)
        return x

    def send(self, h: Any, stage: int) -> None:
        self.dist.send(h.contiguous(), group=self.pp, group_dst=stage)

    def recv(self, stage: int, shape: tuple[int, ...], like: Any) -> Any:
        import torch

        h = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.dist.recv(h, group=self.pp, group_src=stage)
        return h

    def share_logits(self, logits: Any, shape: tuple[int, ...], like: Any) -> Any:
        import torch

        if self.pp is None or self.pp_size == 1:
            return logits
        if logits is None:
            logits = torch.empty(shape, dtype=like.dtype, device=like.device)
        else:
            logits = logits.contiguous()
        self.dist.broadcast(logits, group=self.pp, group_src=self.pp_size - 1)
        return logits

    def broadcast_bytes(self, group: Any, data: np.ndarray) -> np.ndarray:
        import torch

        device = torch.device("cpu")
        if self.dist.get_backend(group) == "nccl":  # NCCL moves CUDA tensors only
            device = torch.device("cuda", torch.cuda.current_device())
        x = torch.from_numpy(data.copy()).to(device)
        self.dist.broadcast(x, group=group, group_src=0)
        return np.asarray(x.cpu().numpy())


def make_engine(tensor_parallel: Any, pipeline_parallel: Any) -> TorchEngine:
    return TorchEngine(tensor_parallel, pipeline_parallel)


def _destroy(dist: Any) -> None:
    """Destroy the process group :func:`launch_groups` joined, if it is still there."""
    if dist.is_initialized():
        dist.destroy_process_group()


def launch_groups(tp: int, pp: int) -> tuple[dict[str, Any], bool]:
    """The groups of a process started by ``torchrun`` (the process group joined here when it
    is not yet: NCCL where CUDA is, gloo otherwise): ranks ``[p T, (p + 1) T)`` form stage
    ``p``'s TP group, ranks ``t, t + T, ...`` TP rank ``t``'s pipeline. Returns the keywords of
    :func:`portable_llm.load` and whether this is rank 0."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        # Left to the interpreter's teardown, the group's threads were still joinable when its
        # destructor ran: a rank that stopped cleanly aborted ("terminate called without an
        # active exception", exit -6) in about half the runs. Destroyed at exit, it joins them.
        atexit.register(_destroy, dist)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp * pp:
        raise ValueError(
            f"--tensor-parallel {tp} x --pipeline-parallel {pp} = {tp * pp} ranks, but torchrun "
            f"started {world}"
        )
    out: dict[str, Any] = {}
    if tp > 1:
        groups = [dist.new_group(list(range(p * tp, (p + 1) * tp))) for p in range(pp)]
        out["tensor_parallel"] = groups[rank // tp] if pp > 1 else dist.group.WORLD
    if pp > 1:
        groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
        out["pipeline_parallel"] = groups[rank % tp] if tp > 1 else dist.group.WORLD
    return out, rank == 0
