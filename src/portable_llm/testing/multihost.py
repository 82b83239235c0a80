"""JAX over several processes (``jax.distributed``), as on several hosts, run on this one: ``python
-m portable_llm.testing.multihost PROCESS NUM_PROCESSES PORT CASE FOLDER OUT``.

Each process joins the coordinator on ``127.0.0.1:PORT`` (``jax.distributed.initialize``, the
CPU collectives over gloo), builds one mesh over the devices of every process and loads its
share of ``FOLDER`` with :func:`~portable_llm.load`, which reads, on each process, only the
shards of its own devices. ``CASE``: ``tp2`` (one device per process, tensor parallel over the
two processes) or ``pp2tp2`` (two devices per process: stage ``s`` holds device ``s`` of each
process, so each stage's tensor-parallel pair spans both processes, and a process that holds a
device of the next stage holds one of this stage too). Each process writes ``OUT/process{i}.npz``
(the logits of :data:`~portable_llm.testing.partition.PROMPT` and the greedy tokens);
:func:`launch_jax_processes` starts the processes and waits for them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from portable_llm.testing.partition import (
    NEW_TOKENS,
    PROMPT,
    free_port,
    host_devices_env,
    run_processes,
)

__all__ = ["CASES", "launch_jax_processes", "run_jax_process"]

#: Each case's host devices per process (``XLA_FLAGS``).
CASES = {"tp2": 1, "pp2tp2": 2}


def run_jax_process(
    process: int, processes: int, port: int, case: str, folder: str, out: str
) -> None:
    """One process of a JAX run over ``processes`` processes (see the module docstring)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=processes, process_id=process
    )
    from jax.sharding import Mesh

    from portable_llm.checkpoint.loader import load
    from portable_llm.core.arrays import to_numpy
    from portable_llm.generation.generate import generate

    devices = jax.devices()  # every process's, process by process
    kw: dict[str, Any]
    if case == "tp2":
        kw = {"tensor_parallel": Mesh(np.asarray(devices), ("tp",))}
    else:  # stage s: device s of each process
        per = len(jax.local_devices())
        rows = np.asarray(devices).reshape(processes, per).T  # (P, T)
        mesh = Mesh(rows, ("pp", "tp"))
        kw = {"tensor_parallel": mesh, "pipeline_parallel": mesh}
    model = load(folder, backend="jax", **kw)
    logits = to_numpy(model([PROMPT])).astype(np.float32)  # replicated: this process's copy
    tokens = [int(t) for t in generate(model, PROMPT, max_new_tokens=NEW_TOKENS, stop=())]
    np.savez(Path(out) / f"process{process}.npz", logits=logits, tokens=np.asarray(tokens))
    jax.distributed.shutdown()


def launch_jax_processes(folder: str | Path, out: str | Path, case: str, *, processes: int = 2,
                         timeout: float = 180.0) -> list[dict[str, Any]]:  # fmt: skip
    """Start ``processes`` local JAX processes of ``case`` and return each one's results."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**host_devices_env(CASES[case]), "OMP_NUM_THREADS": "1"}
    port = str(free_port())
    cmd = [sys.executable, "-m", "portable_llm.testing.multihost"]
    rest = [port, case, str(folder), str(out)]
    run_processes(
        [[*cmd, str(i), str(processes), *rest] for i in range(processes)],
        env=env,
        timeout=timeout,
        names=[f"JAX process {i} of {case}" for i in range(processes)],
    )
    return [dict(np.load(out / f"process{i}.npz")) for i in range(processes)]


if __name__ == "__main__":
    i, n, port, case, folder, out = sys.argv[1:7]
    run_jax_process(int(i), int(n), int(port), case, folder, out)
