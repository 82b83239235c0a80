"""Paged attention against dense attention at S = 2048 (decode), and the memory of a page pool.

``python benchmarks/paged.py [--backend NAME] [--rows B] [--seq S] [--repeat N] [--memory]
[--prefill]``

Time: a decode step (``L = 1``) of ``B`` rows of ``S`` keys each, Llama-shaped heads (H = 32,
H_kv = 8, D = 64, float32), pages of 16 tokens scattered over the pool in a shuffled order.
``dense`` is :func:`portable_llm.scaled_dot_product_attention` over contiguous ``(B, H_kv, S,
D)`` keys (``impl="auto"``: the backend's fused kernel where it has one; ``dense portable``:
the Array API path); each paged variant is
:func:`portable_llm.paged_attention` with that ``impl`` (``--impls``). The samples of every
variant are interleaved, round after round, in a new order each round, and the medians
compared: load from other processes falls on all alike. BLAS and torch run one thread
(``OMP_NUM_THREADS=1``, ``OPENBLAS_NUM_THREADS=1`` unless set): on a loaded machine, spinning
BLAS threads make the timings meaningless.

Memory (``--memory``): the bytes of keys and values a set of unequal sequences holds, in
contiguous caches sized for ``max_seq_len`` and in a page pool holding exactly the pages they
use. Chunked prefill (``--prefill``): 512 queries over 4096 keys on NumPy, the peak memory
and time of the gather path and of the blocked one.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

import portable_llm as pl
from portable_llm.core.dispatch import dispatcher

H, H_KV, D, PAGE = 32, 8, 64, 16


def decode_case(backend: str, B: int, S: int, impls: list[str]) -> tuple[dict, list[str]]:
    """The calls to time, each returning its result, and the variants that apply here."""
    rng = np.random.default_rng(0)
    n = S // PAGE
    pool = pl.PagePool(B * n, PAGE, H_KV, D, "float32", backend=backend)
    ids = np.asarray(pool.allocate(B * n))[rng.permutation(B * n)].reshape(B, n)
    k = rng.standard_normal((B, H_KV, S, D), dtype=np.float32)
    v = rng.standard_normal((B, H_KV, S, D), dtype=np.float32)
    for b in range(B):
        pool.write(
            ids[b].tolist(), 0, pl.asarray(k[b], backend=backend), pl.asarray(v[b], backend=backend)
        )
    q = pl.asarray(rng.standard_normal((B, H, 1, D), dtype=np.float32), backend=backend)
    kd, vd = pl.asarray(k, backend=backend), pl.asarray(v, backend=backend)
    tables = pl.asarray(ids.astype(np.int32), backend=backend)
    lens = pl.asarray(np.full(B, S, dtype=np.int32), backend=backend)
    calls = {
        "dense": lambda: pl.scaled_dot_product_attention(q, kd, vd, mask="causal"),
        "dense portable": lambda: pl.scaled_dot_product_attention(
            q, kd, vd, mask="causal", impl="portable"
        ),
    }
    if "paged_attention" not in dispatcher(pl.get_backend(backend)).native:
        impls = [i for i in impls if i != "native"]
    for impl in impls:
        calls[f"paged {impl}"] = lambda impl=impl: pl.paged_attention(
            q, pool, tables, lens, impl=impl
        )
    with pl.trace() as t:
        pl.paged_attention(q, pool, tables, lens)
    auto = next(e.impl for e in t if e.op == "paged_attention")
    want = pl.to_numpy(calls["dense"]())
    for name, fn in calls.items():  # every variant computes the same numbers
        np.testing.assert_allclose(pl.to_numpy(fn()), want, rtol=1e-4, atol=1e-4, err_msg=name)
    return calls, [f"auto took {auto!r}"]


def time_interleaved(backend: str, calls: dict, repeat: int) -> dict[str, float]:
    bk = pl.get_backend(backend)
    for fn in calls.values():
        bk.synchronize(fn())
    samples: dict[str, list[float]] = {name: [] for name in calls}
    rng = np.random.default_rng(1)
    names = list(calls)
    for _ in range(repeat):
        for i in rng.permutation(len(names)):  # a new order each round: no variant always
            name, fn = names[i], calls[names[i]]  # runs on the caches another one warmed
            t0 = time.perf_counter()
            bk.synchronize(fn())
            samples[name].append(time.perf_counter() - t0)
    return {name: float(np.median(s)) for name, s in samples.items()}


def memory(max_seq_len: int = 2048) -> None:
    lens = [17, 100, 250, 511, 777, 1024, 1500, 2048]
    bytes_per_token = 2 * H_KV * D * 4  # keys and values, float32, one layer
    pool = pl.PagePool(sum(-(-n // PAGE) for n in lens), PAGE, H_KV, D, "float32")
    caches = [pl.PagedKVCache(pool) for _ in lens]
    for c, n in zip(caches, lens, strict=True):
        c.reserve(n)
    used = pool.num_pages - pool.num_free
    paged = used * PAGE * bytes_per_token
    contiguous = len(lens) * max_seq_len * bytes_per_token
    exact = sum(lens) * bytes_per_token
    waste = [len(c.block_table) * PAGE - n for c, n in zip(caches, lens, strict=True)]
    print(f"\nmemory, one layer (H_kv={H_KV}, D={D}, float32), {len(lens)} sequences {lens}:")
    print(f"  tokens held:                      {sum(lens):>6}  ({exact / 2**20:.2f} MiB)")
    print(f"  contiguous, max_seq_len={max_seq_len}:     {contiguous / 2**20:>6.2f} MiB")
    print(f"  page pool, page_size={PAGE}:         {paged / 2**20:>6.2f} MiB  ({used} pages)")
    print(f"  waste per sequence (slots):       {waste}  (max {max(waste)} < {PAGE})")


def prefill(S: int = 4096, L: int = 512) -> None:
    """A chunk of ``L`` queries over ``S`` keys, one row, on NumPy: the peak memory each
    gather path allocates (tracemalloc: the call's own arrays) and its time."""
    import tracemalloc

    rng = np.random.default_rng(0)
    n = S // PAGE
    pool = pl.PagePool(n, PAGE, H_KV, D, "float32")
    ids = np.asarray(pool.allocate(n))[rng.permutation(n)]
    k = rng.standard_normal((H_KV, S, D), dtype=np.float32)
    pool.write(ids.tolist(), 0, k, k)
    q = rng.standard_normal((1, H, L, D), dtype=np.float32)
    tables, lens = ids[None].astype(np.int32), np.asarray([S], dtype=np.int32)
    print(f"\nchunked prefill, NumPy: L={L} queries over S={S} keys, H={H}, H_kv={H_KV}, D={D}:")
    for impl in ("portable", "blocked"):
        fn = lambda impl=impl: pl.paged_attention(q, pool, tables, lens, impl=impl)  # noqa: E731
        fn()
        tracemalloc.start()
        fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        print(f"  {impl:<9} peak {peak / 2**20:6.0f} MiB   {np.median(times) * 1e3:7.0f} ms")
    with pl.trace() as t:
        pl.paged_attention(q, pool, tables, lens)
    print(f"  auto took {next(e.impl for e in t if e.op == 'paged_attention')!r}")


def main() -> None:
    global PAGE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--impls", default="auto,portable,pool,blocked,native")
    ap.add_argument("--page", type=int, default=PAGE, help="tokens per page (default 16)")
    ap.add_argument("--memory", action="store_true", help="also print the memory table")
    ap.add_argument("--prefill", action="store_true", help="also a chunked prefill on NumPy")
    a = ap.parse_args()
    if a.backend == "torch":
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    PAGE = a.page
    calls, notes = decode_case(a.backend, a.rows, a.seq, a.impls.split(","))
    med = time_interleaved(a.backend, calls, a.repeat)
    load = os.getloadavg()[0]
    print(f"{a.backend}: decode, B={a.rows}, S={a.seq}, H={H}, H_kv={H_KV}, D={D}, page {PAGE}, "
          f"float32; load avg {load:.1f}; {', '.join(notes)}")  # fmt: skip
    for name, t in med.items():
        print(f"  {name:<14} {t * 1e3:9.2f} ms   {t / med['dense']:5.2f} x dense")
    if a.memory:
        memory()
    if a.prefill:
        prefill()


if __name__ == "__main__":
    main()
