"""Peak memory of scaled_dot_product_attention, direct vs tiled, on NumPy (tracemalloc).

``python benchmarks/attention_memory.py [S ...]``: one head, 32 queries of dimension 8 over S
keys (default 8192), float32. NumPy reports its allocations to tracemalloc, so the peak is the
memory the call itself allocated (inputs excluded).
"""

import sys
import tracemalloc

import portable_llm as pl
from portable_llm.testing import random_array


def peak(impl: str, S: int, L: int = 32, D: int = 8, block_size: int = 256) -> int:
    q, _ = random_array(0, (1, L, D), "float32")
    k, _ = random_array(1, (1, S, D), "float32")
    v, _ = random_array(2, (1, S, D), "float32")
    tracemalloc.start()
    pl.scaled_dot_product_attention(q, k, v, impl=impl, block_size=block_size)
    result = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result


def main(argv: list[str]) -> None:
    print(f"{'S':>7}  {'direct':>12}  {'tiled (256)':>12}")
    for S in [int(a) for a in argv] or [8192]:
        direct, tiled = peak("portable", S), peak("tiled", S)
        print(f"{S:>7}  {direct / 2**10:>9.0f} KiB  {tiled / 2**10:>9.0f} KiB")


if __name__ == "__main__":
    main(sys.argv[1:])
