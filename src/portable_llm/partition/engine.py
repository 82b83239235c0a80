"""The engines a partitioned model runs on: what each collective is, per array library.

An :class:`Engine` wraps the handles the user passes to :func:`portable_llm.load`
(``tensor_parallel=``, ``pipeline_parallel=``): a JAX mesh, a ``torch.distributed`` process
group or ``DeviceMesh``, an ``mx.distributed.Group``. It says which plans this process builds
(:meth:`Engine.plans`), places each weight (:meth:`Engine.place`), and gives the forward its
collectives: the all-reduce after ``o_proj`` and ``down_proj`` (:meth:`Engine.all_reduce`), the
hand-over of hidden states between pipeline stages (:meth:`Engine.send`, :meth:`Engine.recv`,
:meth:`Engine.move`), the logits shared by every rank (:meth:`Engine.share_logits`) and rank 0's
objects sent to the others (:meth:`Engine.broadcast_object`).
:func:`engine_for` picks the engine of a backend; the engines live in ``jax_mesh.py``,
``torch_dist.py`` and ``mlx_dist.py``, and import their library only when asked for.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from importlib import import_module
from typing import Any, NamedTuple

import numpy as np

from portable_llm.decoder.config import DecoderConfig
from portable_llm.partition.plan import PartitionPlan, plan_partition

__all__ = [
    "ENGINES",
    "HEAD_BYTES",
    "Engine",
    "QuantizedSlice",
    "Reader",
    "engine_for",
    "launch_groups",
]

#: The first collective of :meth:`Engine.broadcast_object` carries this many bytes: the server's
#: message of a decode step fits (one collective per step), a longer one takes a second.
HEAD_BYTES = 1024

#: The backends that partition a model, and the module of each one's engine.
ENGINES = {
    "jax": "portable_llm.partition.jax_mesh",
    "torch": "portable_llm.partition.torch_dist",
    "mlx": "portable_llm.partition.mlx_dist",
}


class QuantizedSlice(NamedTuple):
    """A slice of a quantized weight as a reader gives it: host arrays in MLX's affine layout
    (:class:`~portable_llm.ops.quant.QuantizedWeight`'s), cut along whole groups
    (:func:`~portable_llm.partition.plan.quantized_index`)."""

    packed: np.ndarray  # (.., N, K * bits / 32), uint32
    scales: np.ndarray  # (.., N, K / group_size), the load dtype
    biases: np.ndarray  # (.., N, K / group_size)
    bits: int
    group_size: int

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + self.biases.nbytes


#: ``read(name, index)``: tensor ``name``'s slice ``index`` (in the coordinates of its
#: dequantized shape) as a NumPy array of the load dtype, or a :class:`QuantizedSlice` for a
#: weight kept quantized.
Reader = Callable[[str, tuple[slice, ...]], np.ndarray | QuantizedSlice]


class Engine:
    """The groups of one partitioned model, and the collectives its forward calls.

    ``tp_size``/``pp_size``: the group sizes; ``tp_rank``/``pp_rank``: this process's ranks
    (``pp_rank`` is ``None`` where one process runs every stage: JAX). The defaults are those
    of a process that runs its own ranks (torch, MLX).
    """

    tp: Any = None  # the groups of a process per rank (bind_groups); None: not split so
    pp: Any = None
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int | None = 0

    def bind_groups(self, tp: Any, pp: Any) -> None:
        """Hold the TP and PP groups (``None``: not split that way), each with ``size()`` and
        ``rank()`` (a torch ``ProcessGroup``, an ``mx.distributed.Group``), and read their
        sizes and this process's ranks. One group given to both is refused (it would make
        each process TP rank ``r`` of stage ``r``: a split that holds no model)."""
        if tp is not None and tp is pp:
            raise ValueError(
                f"load: tensor_parallel and pipeline_parallel are the same group (of "
                f"{tp.size()} ranks); a split both ways needs a TP group and a PP group per "
                "process (launch_groups makes them), a split one way one keyword"
            )
        self.tp, self.pp = tp, pp
        if tp is not None:
            self.tp_size, self.tp_rank = tp.size(), tp.rank()
        if pp is not None:
            self.pp_size, self.pp_rank = pp.size(), pp.rank()

    @property
    def single_controller(self) -> bool:
        """Whether this one process drives every rank (JAX)."""
        return self.pp_rank is None

    def plans(self, config: DecoderConfig, group_size: int | None = None) -> list[PartitionPlan]:
        """The plans this process builds: its own, or one per stage (TP rank 0) where one
        process runs every stage. Raises ``ValueError`` before any weight is read."""
        tp = (self.tp_size, self.tp_rank)
        stages = range(self.pp_size) if self.pp_rank is None else [self.pp_rank]
        return [
            plan_partition(config, tp=tp, pp=(self.pp_size, s), group_size=group_size)
            for s in stages
        ]

    def place(self, name: str, shape: tuple[int, ...], plan: PartitionPlan, read: Reader) -> Any:
        """Weight ``name`` (full ``shape``) as this process holds it for ``plan``'s stage: the
        host slice of its rank (a process per rank), or the engine's own array."""
        return read(name, plan.index(name, shape))

    def all_reduce(self, x: Any) -> Any:
        """The sum of ``x`` over the tensor-parallel group."""
        return x

    def move(self, h: Any, stage: int) -> Any:
        """Hidden states ``h`` moved onto stage ``stage`` (one process, every stage)."""
        return h

    def send(self, h: Any, stage: int) -> None:
        """Send hidden states ``h`` to pipeline stage ``stage`` (its rank of this TP rank)."""
        raise NotImplementedError

    def recv(self, stage: int, shape: tuple[int, ...], like: Any) -> Any:
        """Hidden states ``shape`` in ``like``'s dtype and device, from stage ``stage``."""
        raise NotImplementedError

    def share_logits(self, logits: Any, shape: tuple[int, ...], like: Any) -> Any:
        """The last stage's ``logits`` (``None`` elsewhere) on every rank."""
        return logits

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` (TP rank 0 of stage 0; any picklable object) on every rank of the
        model: what keeps ranks that make their own decisions in step (the server's events,
        docs/serve.md). A collective: every rank calls it, in the same order; the other ranks'
        ``obj`` is ignored. Where one process drives every rank (JAX), ``obj`` itself.

        Pickled, sent over stage 0's TP group, then along each pipeline from its stage 0 (the
        other stages' TP groups carry what their rank 0 held, then overwritten), each time as
        :data:`HEAD_BYTES` bytes (the length, then the first bytes: one collective for a short
        message) and, for a longer one, the rest (:meth:`broadcast_bytes`)."""
        for group in (self.tp, self.pp):
            if self.single_controller or group is None or group.size() == 1:
                continue
            data = pickle.dumps(obj) if group.rank() == 0 else b""
            head = np.zeros(HEAD_BYTES, np.uint8)
            head[: min(len(data) + 8, HEAD_BYTES)] = np.frombuffer(
                len(data).to_bytes(8, "little") + data[: HEAD_BYTES - 8], np.uint8
            )
            head = self.broadcast_bytes(group, head)
            n = int.from_bytes(head[:8].tobytes(), "little")
            body = head[8 : 8 + n].tobytes()
            if n > HEAD_BYTES - 8:  # the rest: rank 0's bytes, the others' zeros as room
                rest = np.frombuffer(data[HEAD_BYTES - 8 :], np.uint8) if data else None
                room = np.zeros(n - (HEAD_BYTES - 8), np.uint8) if rest is None else rest
                body += self.broadcast_bytes(group, room).tobytes()
            obj = pickle.loads(body)  # from rank 0 of this very model
        return obj

    def broadcast_bytes(self, group: Any, data: np.ndarray) -> np.ndarray:
        """``group``'s rank 0's ``data`` (uint8 ``(N,)``; the same ``N`` on every rank) on every
        rank of ``group``: the engine's broadcast."""
        raise NotImplementedError


def engine_for(backend: str, tensor_parallel: Any, pipeline_parallel: Any) -> Engine:
    """The engine of ``backend`` for the handles given to :func:`portable_llm.load` (each
    ``None`` or the library's own group; see docs/partition.md).

    Raises
    ------
    ValueError
        A backend that does not partition (NumPy, array-api-strict), or a handle that the
        engine refuses (a mesh without the named axis, a group of another kind).
    """
    if backend not in ENGINES:
        raise ValueError(
            f"load: tensor_parallel/pipeline_parallel need a backend with collectives "
            f"({', '.join(ENGINES)}); got backend={backend!r}"
        )
    module = import_module(ENGINES[backend])
    engine: Engine = module.make_engine(tensor_parallel, pipeline_parallel)
    return engine


def launch_groups(
    backend: str, *, tensor_parallel: int = 1, pipeline_parallel: int = 1
) -> tuple[dict[str, Any], bool]:
    """The groups of a process started by the engine's launcher (``torchrun``, ``mlx.launch``;
    JAX: this process's devices), for a split of ``tensor_parallel`` x ``pipeline_parallel``
    ranks: the keywords of :func:`portable_llm.load` (empty for 1 x 1) and whether this
    process is rank 0 (the one that prints)."""
    if tensor_parallel == pipeline_parallel == 1:
        return {}, True
    if backend not in ENGINES:
        raise ValueError(
            f"--tensor-parallel/--pipeline-parallel need a backend with collectives "
            f"({', '.join(ENGINES)}); got {backend!r}"
        )
    groups: tuple[dict[str, Any], bool] = import_module(ENGINES[backend]).launch_groups(
        tensor_parallel, pipeline_parallel
    )
    return groups
