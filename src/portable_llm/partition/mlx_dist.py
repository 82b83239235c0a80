"""MLX: one process per rank over an ``mx.distributed.Group`` (the ring backend on CPU and
Mac, started by ``mlx.launch``); ``all_sum`` after ``o_proj`` and ``down_proj``, ``send``/``recv``
of the hidden states between stages, the logits summed from the last stage (zeros elsewhere),
since MLX has no broadcast.
"""

from __future__ import annotations

from typing import Any

from portable_llm.partition.engine import Engine

__all__ = ["MlxEngine", "launch_groups", "make_engine"]


def _group(handle: Any, keyword: str) -> Any:
    import mlx.core as mx

    if handle is None:
        return None
    if not isinstance(handle, mx.distributed.Group):
        raise ValueError(
            f"load: {keyword} on MLX must be an mx.distributed.Group, got {type(handle).__name__}"
        )
    return handle


class MlxEngine(Engine):
    """The collectives of an ``mx.distributed`` TP group and PP group."""

    def __init__(self, tensor_parallel: Any, pipeline_parallel: Any) -> None:
        import mlx.core as mx

        self.mx = mx
        tp = _group(tensor_parallel, "tensor_parallel")
        self.bind_groups(tp, _group(pipeline_parallel, "pipeline_parallel"))

    def all_reduce(self, x: Any) -> Any:
        if self.tp is None or self.tp_size == 1:
            return x
        return self.mx.distributed.all_sum(x, group=self.tp)

    def send(self, h: Any, stage: int) -> None:
        self.mx.eval(self.mx.distributed.send(h, stage, group=self.pp))

    def recv(self, stage: int, shape: tuple[int, ...], like: Any) -> Any:
        return self.mx.distributed.recv(shape, like.dtype, stage, group=self.pp)

    def share_logits(self, logits: Any, shape: tuple[int, ...], like: Any) -> Any:
        mx = self.mx
        if self.pp is None or self.pp_size == 1:
            return logits
        if logits is None:
            logits = mx.zeros(shape, dtype=like.dtype)
        return mx.distributed.all_sum(logits, group=self.pp)


def make_engine(tensor_parallel: Any, pipeline_parallel: Any) -> MlxEngine:
    return MlxEngine(tensor_parallel, pipeline_parallel)


def launch_groups(tp: int, pp: int) -> tuple[dict[str, Any], bool]:
    """The groups of a process started by ``mlx.launch`` (``mx.distributed.init()``): ranks
    ``[p T, (p + 1) T)`` form stage ``p``'s TP group (``Group.split``). Returns the keywords of
    :func:`portable_llm.load` and whether this is rank 0."""
    import mlx.core as mx

    world = mx.distributed.init(strict=True)
    size, rank = world.size(), world.rank()
    if size != tp * pp:
        raise ValueError(
            f"--tensor-parallel {tp} x --pipeline-parallel {pp} = {tp * pp} ranks, but "
            f"mlx.launch started {size}"
        )
    if tp > 1 and pp > 1:
        try:
            groups = {
                "tensor_parallel": world.split(rank // tp),
                "pipeline_parallel": world.split(rank % tp),
            }
        except RuntimeError as exc:  # the ring backend: "[ring] Group split not supported."
            raise ValueError(
                f"--tensor-parallel with --pipeline-parallel on MLX needs Group.split, which "
                f"this backend lacks ({exc}); use one of them"
            ) from None
        return groups, rank == 0
    return {"tensor_parallel" if tp > 1 else "pipeline_parallel": world}, rank == 0
