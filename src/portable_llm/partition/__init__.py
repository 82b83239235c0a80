"""Model partition: tensor and pipeline parallelism over the engines' own groups.

See docs/partition.md. :func:`plan_partition` says which weights a rank holds;
:func:`engine_for` wraps a JAX mesh, a ``torch.distributed`` group or an ``mx.distributed``
group; :func:`build_partitioned` makes the model of a reader's tensors, each rank reading only
its own; :class:`PartitionedModel` runs the stages with the engine's collectives.
"""

from portable_llm.partition.build import build_partitioned
from portable_llm.partition.engine import ENGINES, Engine, engine_for, launch_groups
from portable_llm.partition.model import PartitionedModel
from portable_llm.partition.plan import PartitionPlan, plan_partition, stage_layers

__all__ = [
    "ENGINES",
    "Engine",
    "PartitionPlan",
    "PartitionedModel",
    "build_partitioned",
    "engine_for",
    "launch_groups",
    "plan_partition",
    "stage_layers",
]
