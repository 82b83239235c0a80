"""Multi-head latent attention: the cache's bytes per token, and a decode step in each form.

``python benchmarks/latent_cache.py [--backend torch] [--dtype bfloat16] [--tokens 256]``
``python benchmarks/latent_cache.py --model``: a loaded ``deepseek_v3`` model's own caches.

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

``--model``: a small random ``DeepseekV3ForCausalLM`` (transformers, saved to a temporary folder,
loaded with :func:`portable_llm.load`): the bytes per token of ``model.make_cache()`` after a
prefill of ``--tokens`` tokens and of ``model.make_page_pools()`` (``batch_generate``'s pages),
over all layers, beside a full KV cache of the same layers (expanded keys and values in
``KVCache``s); then the same three for DeepSeek V3's and Kimi K2's own ``config.json`` shapes
(``DecoderConfig.cache_dims``, no weights).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

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


TINY = {  # the test model's shapes (tests/test_oracle_families.py), 3 layers
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 32, "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4,
    "topk_group": 2, "first_k_dense_replace": 1, "vocab_size": 300,
}  # fmt: skip


def _full_bytes(cfg: Any, itemsize: int) -> int:
    """A full KV cache's bytes per token over the model: ``H (d_n + d_r + d_v)`` per layer."""
    H, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim
    return cfg.num_hidden_layers * H * (dn + dr + dv) * itemsize


def model_cache(backend: str, dtype: str, tokens: int) -> None:
    import tempfile

    import torch
    import transformers

    from portable_llm.decoder.config import DecoderConfig

    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**TINY)).save_pretrained(
            folder
        )
        model = pl.load(folder, backend=backend, dtype=dtype)
    cfg = model.config
    cache = model.make_cache(step=tokens + 2)
    ids = np.random.default_rng(0).integers(0, TINY["vocab_size"], (1, tokens))
    model(pl.asarray(ids, backend=backend), cache=cache)
    dense = sum(_bytes_per_token(c) for c in cache)
    pools = model.make_page_pools(4, 16)
    paged = sum(
        (pl.to_numpy(p.k_pages).nbytes + pl.to_numpy(p.v_pages).nbytes) // (4 * 16)
        for p in pools
    )  # fmt: skip
    full = []
    for _ in range(cfg.num_hidden_layers):  # the same layers' expanded keys and values
        c = pl.KVCache(step=tokens + 2)
        H, dk, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.head_dim, cfg.v_head_dim
        zeros = [pl.asarray(np.zeros((1, H, tokens, d)), backend=backend, dtype=dtype)
                 for d in (dk, dv)]  # fmt: skip
        c.update_and_fetch(*zeros)
        full.append(_bytes_per_token(c))
    print(f"loaded deepseek_v3 ({cfg.num_hidden_layers} layers, H={cfg.num_attention_heads}, "
          f"R={cfg.kv_lora_rank}, d_r={cfg.head_dim}), {backend} {dtype}, {tokens} tokens: "
          f"make_cache {dense} B per token, page pools {paged} B, full KV cache {sum(full)} B "
          f"({sum(full) / dense:.1f}x the latent cache)")  # fmt: skip
    for name, given in (("DeepSeek V3", {}), ("Kimi K2", {"num_attention_heads": 64})):
        spec = transformers.DeepseekV3Config(**given).to_dict()
        spec["num_key_value_heads"] = spec["num_attention_heads"]
        c = DecoderConfig.from_dict(spec)
        n = c.num_hidden_layers
        lat = sum(2 * d[0] * d[1] for d in map(c.cache_dims, range(n)))  # keys, bfloat16
        lat += n * c.head_dim * 2  # the values: k_pe
        pg = sum(2 * 2 * c.cache_dims(i, paged=True)[1] for i in range(n))
        print(
            f"{name} config ({n} layers, bfloat16): make_cache {lat / 1024:.1f} KiB per token, "
            f"page pools {pg / 1024:.1f} KiB, full KV cache {_full_bytes(c, 2) / 1024:.0f} KiB"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="torch")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--model", action="store_true", help="a loaded deepseek_v3 model's caches")
    args = p.parse_args()
    if args.backend == "torch":
        import torch

        torch.set_num_threads(1)
    with open("/proc/loadavg") as f:
        print("load average:", f.read().split()[:3])
    if args.model:
        model_cache(args.backend, args.dtype, args.tokens)
        return
    for name in MODELS:
        measure(name, args.backend, args.dtype, args.tokens, args.repeat)


if __name__ == "__main__":
    main()
