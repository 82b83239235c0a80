"""Partitioned decode on this machine: one process against 2 local ranks (TP 2, PP 2).

``python benchmarks/partition.py [--engine mlx|torch] [--tokens 32] [--layers 8] [--hidden 512]
[--forward both|prepared|ops]``

A random Llama checkpoint (``--layers`` layers, ``E = --hidden``, ``H = 8``, ``H_kv = 4``,
``I = 3 E``, ``V = 4096``, float32) is decoded greedily for ``--tokens`` tokens: once by one
process, then by 2 ranks over the engine's group (gloo for torch, the ring backend on
127.0.0.1 for MLX) with tensor parallelism, then with pipeline parallelism. Each rank reports
its decode tokens/s, the seconds per token spent in the engine's collectives (all-reduce,
send/recv, the logits shared), the weight bytes it holds against one process's, and its peak
resident memory (``ru_maxrss``). On a 2-core machine two ranks share the cores that one process
has to itself, so a loss is expected: what this measures is the overhead, not a speed-up.
``--forward``: the ranks run their layers as the prepared forward (``PartitionedModel.local``,
the default of a partitioned model), op by op (``local`` set to ``None``), or both in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import portable_llm as pl
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint
from portable_llm.testing.partition import PROMPT, free_port

COLLECTIVES = ("all_reduce", "send", "recv", "share_logits")


def _peak_mb() -> float:
    """This process's peak resident memory (``VmHWM``: ``ru_maxrss`` survives ``exec``, so a
    child started by ``subprocess`` would report its parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _decode(model: Any, tokens: int) -> float:
    gen = pl.generate(model, PROMPT, max_new_tokens=tokens, stop=())
    for _ in gen:
        pass
    return gen.stats.decode_tokens_per_second


def _rank(
    engine: str, mode: str, rank: int, address: str, folder: str, tokens: int, forward: str
) -> None:
    from portable_llm.checkpoint.build import LoadOptions
    from portable_llm.checkpoint.partitioned import read_partitioned
    from portable_llm.partition import PartitionedModel, engine_for

    if engine == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=2)
        group: Any = dist.group.WORLD
    else:
        import mlx.core as mx

        os.environ["MLX_RANK"], os.environ["MLX_HOSTFILE"] = str(rank), address
        group = mx.distributed.init(strict=True, backend="ring")
    kw = {"tensor_parallel": group} if mode == "tp" else {"pipeline_parallel": group}
    eng = engine_for(engine, kw.get("tensor_parallel"), kw.get("pipeline_parallel"))
    model, report = read_partitioned(folder, LoadOptions(backend=engine), eng)
    assert isinstance(model, PartitionedModel)
    if forward == "ops":
        model.local = None  # the blocks, op by op
    spent = dict.fromkeys(COLLECTIVES, 0.0)
    for name in COLLECTIVES:
        fn = getattr(eng, name)

        def timed(*args: Any, _fn: Any = fn, _name: str = name) -> Any:
            t = time.perf_counter()
            out = _fn(*args)
            if out is not None and engine == "mlx":
                import mlx.core as mx

                mx.eval(out)  # MLX is lazy: the collective runs here
            spent[_name] += time.perf_counter() - t
            return out

        setattr(eng, name, timed)
    if model.local is not None and model.local.reduce is not None:  # bound at load
        model.local.reduce = eng.all_reduce  # the timed one
    _decode(model, 4)  # warm-up
    spent.update(dict.fromkeys(COLLECTIVES, 0.0))
    tps = _decode(model, tokens)
    per_token = sum(spent.values()) / (tokens + len(PROMPT))
    print(json.dumps({
        "mode": mode, "forward": forward, "rank": rank, "tokens_per_s": tps,
        "collective_ms_per_token": 1e3 * per_token, "held": report.held / report.total,
        "maxrss_mb": _peak_mb(),
    }))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", default="mlx", choices=["mlx", "torch"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--forward", default="both", choices=["both", "prepared", "ops"])
    args = ap.parse_args()
    E = args.hidden
    cfg = tiny_config(
        "llama", hidden_size=E, intermediate_size=3 * E, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
        attention_bias=False, mlp_bias=False, max_position_embeddings=1024,
    )  # fmt: skip
    folder = tempfile.mkdtemp(prefix="partition-bench-")
    write_checkpoint(folder, cfg)
    model = pl.load(folder, backend=args.engine)
    _decode(model, 4)
    one = _decode(model, args.tokens)
    rss = _peak_mb()
    print(f"{args.engine}: one process {one:.1f} tok/s, peak RSS {rss:.0f} MB")
    forwards = ["prepared", "ops"] if args.forward == "both" else [args.forward]
    for mode, forward in [(m, f) for m in ("tp", "pp") for f in forwards]:
        if args.engine == "torch":
            address = f"127.0.0.1:{free_port()}"
        else:
            host = Path(folder) / "hostfile.json"
            host.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(2)]))
            address = str(host)
        cmd = [sys.executable, __file__, "--rank"]
        procs = [
            subprocess.Popen(
                [*cmd, args.engine, mode, str(r), address, folder, str(args.tokens), forward],
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        for p in procs:
            r = json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1])
            print(
                f"  {mode} 2 ({forward}) rank {r['rank']}: {r['tokens_per_s']:.1f} tok/s "
                f"({r['tokens_per_s'] / one:.2f}x), collectives "
                f"{r['collective_ms_per_token']:.2f} ms/token, weights held {r['held']:.2f}x, "
                f"peak RSS {r['maxrss_mb']:.0f} MB"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        e, m, r, a, f, n, fw = sys.argv[2:9]
        _rank(e, m, int(r), a, f, int(n), fw)
    else:
        main()
