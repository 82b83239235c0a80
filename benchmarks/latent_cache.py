"""Multi-head latent attention: the cache's bytes per token, and a decode step in each form.

``python benchmarks/latent_cache.py [--backend torch] [--dtype bfloat16] [--tokens 256]``

For the attention shapes of DeepSeek V3 / Kimi K2 (``H`` heads, ``kv_lora_rank`` 512,
``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64, ``v_head_dim`` 128), a prefill of
``--tokens`` tokens and one decode step through :func:`portable_llm.latent_attention` with a
:class:`portable_llm.KVCache`, which then holds the latent ``c_kv`` and the rotary key ``k_pe``;
beside it a second ``KVCache`` holding what a full cache of the same layer holds, the expanded
keys ``(H, d_n + d_r)`` and values ``(H, d_v)`` of the same tokens. Bytes per token are read off
the caches' buffers (``sum(nbytes) / capacity``), per layer and for the model's layers. The
cache does not depend on the hidden size or the query's LoRA rank, so the layer here is narrow
(``E = 256``, ``q_lora_rank = 64``) to keep the weights small. Then the decode step's time in
the expanded and the absorbed forms (median of ``--repeat`` calls, one thread).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

import portable_llm as pl
from portable_llm.testing import LATENT_DIMS, random_latent_layer

MODELS = {  # heads, layers (config.json of each)
    "DeepSeek V3": (128, 61),
    "Kimi K2": (64, 61),
}
SHAPE = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}


def _bytes_per_token(cache: pl.KVCache) -> int:
    return sum(pl.to_numpy(b).nbytes for b in cache.state) // cache.capacity


def _layer(heads: int, backend: str, dtype: str) -> dict:
    sizes = {"hidden_size": 256, "num_heads": heads, "q_lora_rank": 64, "out_size": 256, **SHAPE}
    weights, _ = random_latent_layer(0, sizes, dtype, backend=backend)
    return {**weights, **{n: sizes[n] for n in LATENT_DIMS}}


def _sync(x: object) -> object:
    pl.to_numpy(x[:, :, :1])  # type: ignore[index]  # waits for lazy (MLX) and async results
    return x


def measure(name: str, backend: str, dtype: str, tokens: int, repeat: int) -> None:
    heads, layers = MODELS[name]
    kw = _layer(heads, backend, dtype)
    rng = np.random.default_rng(1)
    x = pl.asarray(rng.uniform(-1, 1, (1, tokens + 1, 256)), backend=backend, dtype=dtype)
    latent = pl.KVCache(step=tokens + 2)
    pl.latent_attention(x[:, :tokens, :], **kw, cache=latent)
    dn, dr, dv = SHAPE["qk_nope_head_dim"], SHAPE["qk_rope_head_dim"], SHAPE["v_head_dim"]
    full = pl.KVCache(step=tokens + 2)
    k = pl.asarray(np.zeros((1, heads, tokens, dn + dr)), backend=backend, dtype=dtype)
    full.update_and_fetch(k, pl.asarray(np.zeros((1, heads, tokens, dv)), backend=backend,
                                        dtype=dtype))  # fmt: skip
    lat, ful = _bytes_per_token(latent), _bytes_per_token(full)
    print(f"{name} ({heads} heads, {layers} layers), {backend} {dtype}: latent cache {lat} B "
          f"per token and layer, full KV cache {ful} B ({ful / lat:.1f}x); per token over the "
          f"model {lat * layers / 1024:.1f} KiB against {ful * layers / 1024:.1f} KiB")  # fmt: skip
    step = x[:, tokens:, :]
    for form in ("expanded", "absorbed"):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            _sync(pl.latent_attention(step, **kw, cache=latent, form=form))
            times.append(time.perf_counter() - t0)
            latent.trim(1)
        print(f"  decode step over {tokens} cached tokens, {form}: "
              f"{statistics.median(times) * 1e3:.2f} ms (median of {repeat})")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="torch")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    if args.backend == "torch":
        import torch

        torch.set_num_threads(1)
    with open("/proc/loadavg") as f:
        print("load average:", f.read().split()[:3])
    for name in MODELS:
        measure(name, args.backend, args.dtype, args.tokens, args.repeat)


if __name__ == "__main__":
    main()
