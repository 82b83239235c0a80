"""Decode tok/s of a hybrid and a MoE model of 2026 (issue 31): portable_llm on torch beside
transformers and on MLX beside mlx-lm, the same weights.

No LFM2 or Qwen3-MoE checkpoint is on this machine, so each model is random-init by
transformers, of realistic layer shapes but few layers, saved with ``save_pretrained``; mlx-lm
reads the same folder (``mlx_lm.utils.load_model``, its ``sanitize``; ``config.json`` gets
transformers 4's spellings beside 5's, which mlx-lm's model arguments require). The engines and the
interleaved rounds are ``decode_rounds.py``'s (beside this file): float32, a 128-token prompt,
``--new`` tokens, each round runs every engine once in turn, medians over ``--rounds``.
One thread: ``torch.set_num_threads(1)`` and ``OMP_NUM_THREADS``/``OPENBLAS_NUM_THREADS`` 1
before any import (MLX has no thread setting of its own: its CPU stream runs on a worker
thread beside Python's, so an MLX engine keeps up to 2 threads busy).

    python benchmarks/arch2026_decode.py lfm2 FOLDER [--rounds 7 --new 24]
    python benchmarks/arch2026_decode.py qwen3_moe FOLDER

- ``lfm2``: 42.9 M parameters, E=512, 8 layers (5 short convolutions of 3 taps, 3 attention
  layers of 8 heads over 4 KV heads), the MLP width adjusted to 1536, V=32000, tied head (the
  shape of the LFM2 row beside transformers in benchmarks/README.md);
- ``qwen3_moe``: E=512, 8 layers of 8 heads over 2 KV heads of 64 features with q/k norms, 16
  experts of width 256, top-4 (normalized), V=32000, untied head.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

CONFIGS = {
    "lfm2": {
        "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 2304,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
        "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention",
                        "conv", "full_attention"],
        "conv_L_cache": 3, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": True, "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
    },
    "qwen3_moe": {
        "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1536,
        "moe_intermediate_size": 256, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
}  # fmt: skip


#: (portable_llm's engine, its peer) whose per-round ratio is printed.
PAIRS = (
    ("portable_llm torch", "transformers"),
    ("portable_llm mlx", "mlx-lm generate_step"),
    ("portable_llm mlx", "mlx-lm plain loop"),
)


def write(family: str, folder: Path) -> Path:
    """A random-init transformers model of ``family`` saved in ``folder`` (kept if there)."""
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(family, **CONFIGS[family])
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 1:  # norms (and LFM2's conv has no bias here)
                p.copy_(torch.rand_like(p) * 0.4 + 0.8)
            else:
                p.copy_(torch.randn_like(p) * 0.05)
    print(f"{family}: {sum(p.numel() for p in m.parameters()) / 1e6:.1f} M parameters")
    m.save_pretrained(folder)
    # mlx-lm's ModelArgs read transformers 4's spellings (its dataclasses require them):
    # the same values, beside transformers 5's.
    path = folder / "config.json"
    written = json.loads(path.read_text())
    theta = {"rope_theta": written["rope_parameters"]["rope_theta"]}
    if family == "lfm2":
        v4 = {"block_dim": cfg.hidden_size, "block_ff_dim": cfg.intermediate_size}
    else:
        v4 = {"num_experts": written["num_local_experts"]}
    path.write_text(json.dumps({**written, **theta, **v4}, indent=2))
    return folder


def cpu_flags() -> str:
    """The CPU's AVX-512 VNNI/BF16 and AMX flags, as /proc/cpuinfo lists them."""
    flags = set(Path("/proc/cpuinfo").read_text().split())
    wanted = ("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
    return " ".join(f if f in flags else f"no {f}" for f in wanted)


def main() -> None:
    import torch

    from decode_rounds import interleaved  # benchmarks/decode_rounds.py, beside this file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=sorted(CONFIGS))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new", type=int, default=24, help="new tokens per run")
    parser.add_argument("--backend", action="append", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = write(args.family, args.folder)
    rates, loads = interleaved(
        folder, args.backend or ["torch", "mlx"], "float32", args.rounds, args.new
    )
    print(
        f"{args.family}, float32, {args.new} new tokens after 128, {args.rounds} interleaved "
        f"rounds, 1 thread, load {min(loads):.1f}-{max(loads):.1f}, CPU: {cpu_flags()}"
    )
    for name, values in rates.items():
        print(
            f"{name:32s} median {np.median(values):6.2f} tok/s   "
            f"(rounds: {', '.join(f'{v:.2f}' for v in values)})"
        )
    for ours, peer in PAIRS:  # the same round's ratio: the load moves less within a round
        if ours in rates and peer in rates:
            ratio = np.median(np.divide(rates[ours], rates[peer]))
            print(f"{ours} / {peer}: median of the rounds' ratios {ratio:.2f}")


if __name__ == "__main__":
    main()
