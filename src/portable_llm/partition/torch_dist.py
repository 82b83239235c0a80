"""torch.distributed: one process per rank; ``all_reduce`` after ``o_proj`` and ``down_proj``,
``send``/``recv`` of the hidden states between stages, the logits broadcast from the last one.

``tensor_parallel`` / ``pipeline_parallel``: a ``torch.distributed`` process group (the default
group: ``torch.distributed.group.WORLD``) or a 1-D ``DeviceMesh`` (its group). Gloo on CPU,
NCCL on CUDA: the collectives are the group's own.
"""

from __future__ import annotations

from typing import Any

from portable_llm.partition.engine import Engine

__all__ = ["TorchEngine", "make_engine"]


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
        self.tp = _group(tensor_parallel, "tensor_parallel")
        self.pp = _group(pipeline_parallel, "pipeline_parallel")
        if self.tp is not None:
            self.tp_size, self.tp_rank = self.tp.size(), self.tp.rank()
        if self.pp is not None:
            self.pp_size, self.pp_rank = self.pp.size(), self.pp.rank()

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


def make_engine(tensor_parallel: Any, pipeline_parallel: Any) -> TorchEngine:
    return TorchEngine(tensor_parallel, pipeline_parallel)
