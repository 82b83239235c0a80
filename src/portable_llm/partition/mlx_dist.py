"""MLX: one process per rank over an ``mx.distributed.Group`` (the ring backend on CPU and
Mac, started by ``mlx.launch``); ``all_sum`` after ``o_proj`` and ``down_proj``, ``send``/``recv``
of the hidden states between stages, the logits summed from the last stage (zeros elsewhere),
since MLX has no broadcast.

Both kinds at once need a TP group and a PP group inside the world: ``Group.split``, which
MLX's ring backend lacks ("[ring] Group split not supported", MLX 0.32), and whose send and
recv reach only a rank's two neighbours on the ring. For 2 x 2 on 4 ring ranks
:func:`ring_groups` lays the stages out so that every link is between neighbours (stage 0:
ranks 0, 1; stage 1: ranks 3, 2, so the pipelines are 0 -> 3 and 1 -> 2) and gives
:class:`NeighborGroup` s, whose all-sum is one exchange with the other rank over the world's
send and recv.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_llm.partition.engine import Engine

__all__ = ["MlxEngine", "NeighborGroup", "launch_groups", "make_engine", "ring_groups"]


class NeighborGroup:
    """Two ranks of an ``mx.distributed`` world that are neighbours on its ring, as a group:
    ``size()``, ``rank()`` (this process's place in ``members``), and the collectives the
    engine calls over the world's ``send``/``recv`` (a backend without ``Group.split``)."""

    def __init__(self, world: Any, members: list[int]) -> None:
        n, me = world.size(), world.rank()
        a, b = members
        if len(set(members)) != 2 or (a - b) % n not in (1, n - 1) or me not in members:
            raise ValueError(
                f"NeighborGroup: ranks {members} of a ring of {n} must be two neighbours, one "
                f"of them this process ({me})"
            )
        self.world, self.members = world, list(members)
        self.me = members.index(me)

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self.me

    def all_sum(self, x: Any) -> Any:
        """``members[0]``'s ``x`` plus ``members[1]``'s, the same sum on both: one exchange
        (the lower world rank sends first, so neither waits on the other's send). Every
        message is evaluated when issued: a lazy ``recv`` evaluated later, or never (a forward
        whose logits are not read), would take another message off the link."""
        import mlx.core as mx

        peer, world = self.members[1 - self.me], self.world
        if world.rank() < peer:
            mx.eval(mx.distributed.send(x, peer, group=world))
            y = mx.distributed.recv(x.shape, x.dtype, peer, group=world)
            mx.eval(y)
        else:
            y = mx.distributed.recv(x.shape, x.dtype, peer, group=world)
            mx.eval(y)
            mx.eval(mx.distributed.send(x, peer, group=world))
        return x + y if self.me == 0 else y + x

    def send(self, x: Any, rank: int) -> None:
        import mlx.core as mx

        mx.eval(mx.distributed.send(x, self.members[rank], group=self.world))

    def recv(self, shape: tuple[int, ...], dtype: Any, rank: int) -> Any:
        import mlx.core as mx

        y = mx.distributed.recv(shape, dtype, self.members[rank], group=self.world)
        mx.eval(y)  # now, in the order of the messages (see all_sum)
        return y


def ring_groups(world: Any, tp: int, pp: int) -> dict[str, Any]:
    """The keywords of :func:`portable_llm.load` for ``tp`` x ``pp`` ranks of ``world``:
    ``Group.split`` where the backend has it (ranks ``[p T, (p + 1) T)`` form stage ``p``),
    else, for 2 x 2 on a ring of 4, :class:`NeighborGroup` s (stage 0: ranks 0, 1; stage 1:
    ranks 3, 2). Raises ``ValueError`` for other sizes on a backend without ``Group.split``."""
    rank = world.rank()
    try:
        return {
            "tensor_parallel": world.split(rank // tp),
            "pipeline_parallel": world.split(rank % tp),
        }
    except RuntimeError as exc:  # the ring backend: "[ring] Group split not supported."
        if not (tp == pp == 2 and world.size() == 4):
            raise ValueError(
                f"tensor_parallel={tp} with pipeline_parallel={pp} on MLX needs Group.split, "
                f"which this backend lacks ({exc}); on the ring backend only 2 x 2 over 4 "
                "ranks (each rank's partners its ring neighbours), or one of the two"
            ) from None
    stages = [[0, 1], [3, 2]]  # (P, T) world ranks: every TP pair and pipeline neighbours
    stage = next(s for s, row in enumerate(stages) if rank in row)
    t = stages[stage].index(rank)
    return {
        "tensor_parallel": NeighborGroup(world, stages[stage]),
        "pipeline_parallel": NeighborGroup(world, [stages[0][t], stages[1][t]]),
    }


def _group(handle: Any, keyword: str) -> Any:
    import mlx.core as mx

    if handle is None or isinstance(handle, NeighborGroup):
        return handle
    if not isinstance(handle, mx.distributed.Group):
        raise ValueError(
            f"load: {keyword} on MLX must be an mx.distributed.Group (or a NeighborGroup), got "
            f"{type(handle).__name__}"
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
        return self._all_sum(self.tp, x)

    def _all_sum(self, group: Any, x: Any) -> Any:
        if isinstance(group, NeighborGroup):
            return group.all_sum(x)
        return self.mx.distributed.all_sum(x, group=group)

    def send(self, h: Any, stage: int) -> None:
        if isinstance(self.pp, NeighborGroup):
            return self.pp.send(h, stage)
        self.mx.eval(self.mx.distributed.send(h, stage, group=self.pp))

    def recv(self, stage: int, shape: tuple[int, ...], like: Any) -> Any:
        if isinstance(self.pp, NeighborGroup):
            return self.pp.recv(shape, like.dtype, stage)
        h = self.mx.distributed.recv(shape, like.dtype, stage, group=self.pp)
        self.mx.eval(h)  # now, in the order of the messages (see NeighborGroup.all_sum)
        return h

    def share_logits(self, logits: Any, shape: tuple[int, ...], like: Any) -> Any:
        mx = self.mx
        if self.pp is None or self.pp_size == 1:
            return logits
        if logits is None:
            logits = mx.zeros(shape, dtype=like.dtype)
        return self._all_sum(self.pp, logits)

    def broadcast_bytes(self, group: Any, data: np.ndarray) -> np.ndarray:
        """MLX has no broadcast: ``data`` summed with the other ranks' zeros."""
        if group.rank() != 0:
            data = np.zeros_like(data)
        got = self._all_sum(group, self.mx.array(data))
        return np.asarray(got, dtype=np.uint8)


def make_engine(tensor_parallel: Any, pipeline_parallel: Any) -> MlxEngine:
    return MlxEngine(tensor_parallel, pipeline_parallel)


def launch_groups(tp: int, pp: int) -> tuple[dict[str, Any], bool]:
    """The groups of a process started by ``mlx.launch`` (``mx.distributed.init()``): both
    kinds as :func:`ring_groups` makes them. Returns the keywords of :func:`portable_llm.load`
    and whether this is rank 0."""
    import mlx.core as mx

    world = mx.distributed.init(strict=True)
    size, rank = world.size(), world.rank()
    if size != tp * pp:
        raise ValueError(
            f"--tensor-parallel {tp} x --pipeline-parallel {pp} = {tp * pp} ranks, but "
            f"mlx.launch started {size}"
        )
    if tp > 1 and pp > 1:
        return ring_groups(world, tp, pp), rank == 0
    return {"tensor_parallel" if tp > 1 else "pipeline_parallel": world}, rank == 0
