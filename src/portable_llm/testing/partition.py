"""Run a partitioned model in local processes, one per rank, as the tests do (and as a user can,
to check a setup): ``python -m portable_llm.testing.partition ENGINE MODE RANK WORLD ADDRESS
FOLDER OUT DTYPE DEQUANTIZE MORE`` (``DEQUANTIZE``: ``auto``, ``True`` or ``False``;
``MORE``: ``True`` to run ``batch_generate`` and ``speculative_generate`` too).

``ENGINE``: ``torch`` (gloo over ``tcp://ADDRESS``) or ``mlx`` (the ring backend: ``ADDRESS`` is
the hostfile, a JSON list of one ``["127.0.0.1:port"]`` list per rank, as ``mlx.launch`` writes
it); ``MODE``: ``tp`` or ``pp`` (the whole world as one group), or ``pp2tp2`` (4 ranks). Each
rank writes ``OUT/rank{RANK}.npz``: the logits of :data:`PROMPT` (float32), the greedy tokens of
:func:`~portable_llm.generate` (and of ``batch_generate`` and ``speculative_generate``), the
layers and KV heads of its page pools (``pools``), and the bytes it held and touched
(``LoadReport``). :func:`launch` starts the processes and waits for
them. JAX drives every device from one process: :func:`launch_jax` runs :func:`run_jax`'s cases
(``tp2``, ``pp2``, ``pp2tp2``, ...) in a process with 8 host devices (``python -m
portable_llm.testing.partition jax FOLDER OUT DTYPE DEQUANTIZE CASES... [--batch]``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "NEW_TOKENS",
    "PROMPT",
    "free_port",
    "host_devices_env",
    "launch",
    "launch_jax",
    "more_tokens",
    "run_jax",
    "run_rank",
]

#: The prompt each rank runs (token ids below the tiny checkpoints' vocabulary).
PROMPT = [3, 17, 42, 9, 100, 7, 250, 31]
#: Greedy tokens generated after it.
NEW_TOKENS = 8


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_devices_env(devices: int) -> dict[str, str]:
    """This process's environment for a JAX subprocess with ``devices`` host (CPU) devices: the
    caller's ``XLA_FLAGS`` kept (the JAX test envs' compile settings, which cut the compile time
    by a third), ``--xla_force_host_platform_device_count`` added."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "XLA_FLAGS": flags.strip()}


def run_rank(
    engine: str,
    mode: str,
    rank: int,
    world: int,
    address: str,
    folder: str,
    out: str,
    dtype: str = "float32",
    dequantize: bool | str = "auto",
    more: bool = True,
) -> None:
    """One rank: join the group, load its share of ``folder`` in ``dtype`` (``dequantize``:
    :func:`~portable_llm.load`'s), write its results (logits as float32) to ``out``; ``more``:
    the tokens of :func:`more_tokens` too."""
    from portable_llm.checkpoint.build import LoadOptions
    from portable_llm.checkpoint.partitioned import read_partitioned
    from portable_llm.core.arrays import to_numpy
    from portable_llm.generation.generate import generate
    from portable_llm.partition.engine import engine_for
    from portable_llm.partition.model import PartitionedModel

    group: Any
    if engine == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world)
        group = dist.group.WORLD
    else:
        import mlx.core as mx

        os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"] = str(rank), address
        group = mx.distributed.init(strict=True, backend="ring")
        assert group.rank() == rank and group.size() == world
    kw = {"tensor_parallel" if mode == "tp" else "pipeline_parallel": group}
    if mode == "pp2tp2":  # 4 ranks: two stages of a TP pair (see each engine's groups)
        if engine == "torch":
            from portable_llm.partition.torch_dist import launch_groups

            kw = launch_groups(2, 2)[0]
        else:
            from portable_llm.partition.mlx_dist import ring_groups

            kw = ring_groups(group, 2, 2)
    eng = engine_for(engine, kw.get("tensor_parallel"), kw.get("pipeline_parallel"))
    options = LoadOptions(backend=engine, dtype=dtype, dequantize=dequantize)
    model, report = read_partitioned(folder, options, eng)
    logits = to_numpy(model([PROMPT])).astype(np.float32)
    tokens = [int(t) for t in generate(model, PROMPT, max_new_tokens=NEW_TOKENS, stop=())]
    results: dict[str, Any] = {"logits": logits, "tokens": np.asarray(tokens)}
    # whether the rank ran the prepared forward (decoder.prepared), its all-reduce bound in
    results["prepared"] = isinstance(model, PartitionedModel) and model.local is not None
    pools = model.make_page_pools(1, 4)  # the pools batch_generate makes: (layers, H_kv) here
    results["pools"] = np.asarray([len(pools), pools[0].num_kv_heads])
    if more:
        results.update(more_tokens(model))
    results.update(held=report.held, touched=report.touched, total=report.total)
    np.savez(Path(out) / f"rank{rank}.npz", file_bytes=report.file, **results)
    if engine == "torch":
        dist.destroy_process_group()


def more_tokens(model: Any) -> dict[str, np.ndarray]:
    """Greedy tokens of :func:`~portable_llm.batch_generate` (three prompts of three lengths,
    one paged forward per step on a model with one) and of
    :func:`~portable_llm.speculative_generate` with the model as its own draft."""
    from portable_llm.generation.batch import batch_generate
    from portable_llm.generation.speculative import speculative_generate

    rows = batch_generate(
        model, [PROMPT, PROMPT[:5], PROMPT[:3]], max_new_tokens=NEW_TOKENS, stop=()
    )
    spec = speculative_generate(
        model, model, PROMPT, max_new_tokens=NEW_TOKENS, stop=(), num_draft_tokens=2
    )
    return {
        "batch": np.asarray(rows),
        "speculative": np.asarray([int(t) for t in spec]),
    }


def run_processes(
    commands: list[list[str]], /, *, env: dict[str, str], timeout: float, names: list[str]
) -> None:
    """Start every command at once (they talk to each other), wait for all of them within
    ``timeout`` seconds each, kill what is left, and raise ``RuntimeError`` with the output tail
    of the first that failed (``names[i]`` says which)."""
    procs = [
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for c in commands
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for name, p, log in zip(names, procs, logs, strict=True):
        if p.returncode:
            raise RuntimeError(f"{name} failed ({p.returncode}):\n{log[-3000:]}")


def launch(engine: str, mode: str, folder: str | Path, out: str | Path, *, world: int = 2,
           dtype: str = "float32", dequantize: bool | str = "auto", more: bool = True,
           timeout: float = 120.0) -> list[dict[str, Any]]:  # fmt: skip
    """Start ``world`` local ranks of ``engine`` in ``mode`` and return each one's results
    (``dtype``, ``dequantize``, ``more``: :func:`run_rank`'s)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if engine == "torch":
        address = f"127.0.0.1:{free_port()}"
    else:
        hostfile = out / "hostfile.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(world)]))
        address = str(hostfile)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "portable_llm.testing.partition", engine, mode]
    rest = [address, str(folder), str(out), dtype, str(dequantize), str(more)]
    run_processes(
        [[*cmd, str(r), str(world), *rest] for r in range(world)],
        env=env,
        timeout=timeout,
        names=[f"rank {r} of {engine} {mode}" for r in range(world)],
    )
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(world)]


def _mesh(case: str) -> dict[str, Any]:
    """The keywords of one JAX case: ``tp4`` (a 1-axis mesh of 4 devices), ``pp2``, ``pp2tp2``
    (a 2-D mesh with axes "pp" and "tp", passed to both)."""
    import re

    import jax
    from jax.sharding import Mesh

    m = re.fullmatch(r"(?:pp(\d))?(?:tp(\d))?", case)
    assert m, case
    P, T = int(m[1] or 1), int(m[2] or 1)
    devices = np.asarray(jax.devices()[: P * T])
    if m[1] and m[2]:
        mesh = Mesh(devices.reshape(P, T), ("pp", "tp"))
        return {"tensor_parallel": mesh, "pipeline_parallel": mesh}
    if m[1]:
        return {"pipeline_parallel": Mesh(devices, ("stages",))}
    return {"tensor_parallel": (Mesh(devices, ("model",)), "model")}


def run_jax(
    folder: str,
    out: str,
    cases: list[str],
    dtype: str = "float32",
    dequantize: bool | str = "auto",
    batch: bool = False,
) -> None:
    """The JAX cases in this process (started with ``XLA_FLAGS`` asking for 8 host devices):
    ``OUT/{case}.npz`` for each (logits, greedy tokens, ``kv_heads``: the most KV heads one
    device's cache holds, ``pool_heads``: the same of the page pools after one paged forward
    of the prompt, whose last logits are ``paged`` (meshes only); ``batch``: the tokens of
    ``batch_generate`` too), and ``one`` for the model on one device. The ids arrive as an
    ordinary JAX array on the first device."""
    import jax

    from portable_llm.caches.paged import PagedKVCache
    from portable_llm.checkpoint.loader import load
    from portable_llm.core.arrays import to_numpy
    from portable_llm.generation.generate import generate

    for case in ["one", *cases]:
        kw = {} if case == "one" else _mesh(case)
        model = load(folder, backend="jax", dtype=dtype, dequantize=dequantize, **kw)
        ids = jax.device_put(np.asarray([PROMPT]), jax.devices()[0])  # on the first device
        logits = to_numpy(model(ids)).astype(np.float32)
        tokens = [int(t) for t in generate(model, PROMPT, max_new_tokens=NEW_TOKENS, stop=())]
        cache = model.make_cache()
        model(ids, cache=cache)
        k = cache[-1].state[0]  # (B, H_kv, S, D): the heads each device holds
        heads = max(int(s.data.shape[1]) for s in k.addressable_shards)
        more: dict[str, Any] = {}
        if case != "one":  # the page pools batch_generate makes, filled by one paged forward
            # of the prompt: the most KV heads one device's pages hold, the last logits
            pools = model.make_page_pools(-(-len(PROMPT) // 4), 4)
            paged = model.forward_paged([PROMPT], caches=[[PagedKVCache(p) for p in pools]])
            pages = [p.k_pages for p in pools] + [p.v_pages for p in pools]
            more["pool_heads"] = max(
                int(s.data.shape[1]) for a in pages for s in a.addressable_shards
            )
            more["paged"] = to_numpy(paged)  # (1, V)
        if batch:
            from portable_llm.generation.batch import batch_generate

            rows = [PROMPT, PROMPT[:5], PROMPT[:3]]
            more["batch"] = np.asarray(
                batch_generate(model, rows, max_new_tokens=NEW_TOKENS, stop=())
            )
        np.savez(
            Path(out) / f"{case}.npz",
            logits=logits,
            tokens=np.asarray(tokens),
            kv_heads=heads,
            **more,
        )


def launch_jax(folder: str | Path, out: str | Path, cases: list[str], *, dtype: str = "float32",
               dequantize: bool | str = "auto", batch: bool = False,
               timeout: float = 300.0) -> dict[str, dict[str, Any]]:  # fmt: skip
    """:func:`run_jax` in a fresh process with 8 host devices; each case's results
    (``batch``: :func:`run_jax`'s)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    env = host_devices_env(8)
    args = ["jax", str(folder), str(out), dtype, str(dequantize), *cases]
    if batch:
        args.append("--batch")
    done = subprocess.run(
        [sys.executable, "-m", "portable_llm.testing.partition", *args],
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"JAX cases {cases} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return {c: dict(np.load(out / f"{c}.npz")) for c in ["one", *cases]}


if __name__ == "__main__":
    flags: dict[str, bool | str] = {"True": True, "False": False}
    if sys.argv[1] == "jax":
        deq = flags.get(sys.argv[5], sys.argv[5])
        cases = [c for c in sys.argv[6:] if c != "--batch"]
        run_jax(sys.argv[2], sys.argv[3], cases, sys.argv[4], deq, "--batch" in sys.argv[6:])
    else:
        e, m, r, w, a, f, o, d, q, more = sys.argv[1:11]
        run_rank(e, m, int(r), int(w), a, f, o, d, flags.get(q, q), more == "True")
