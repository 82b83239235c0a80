"""The measured rule: keep a weight's codes, or multiply its dequantized floats.

:data:`KEEP_CODES_FROM` records where a decode projection kept quantized is at least as fast as
the dense product of its floats; :func:`keeps_codes` reads it, and
:func:`~portable_llm.ops.quant.public.fastest_form` applies it to one weight.
:data:`INT8_BY_DEFAULT` records where the 8-bit activation mode is the default of
``pl.load(..., activations="auto")`` (:func:`int8_by_default` reads it).
"""

from __future__ import annotations

from typing import Any

from portable_llm.backends import Backend
from portable_llm.ops.quant.format import QuantizedWeight

__all__ = [
    "INT8_BY_DEFAULT",
    "KEEP_CODES_FROM",
    "device_kind",
    "int8_by_default",
    "keeps_codes",
]

#: ``(backend, device kind, dtype, bits) -> N``: from ``N`` output rows on, a decode projection
#: (one row of x, ``impl="auto"``) kept quantized is at least as fast as the dense matmul of its
#: dequantized weight; a combination absent here never is (its quantized path is no faster than
#: dequantize-then-matmul, e.g. NumPy (native/numpy.py's blocks: 0.5-0.8x per projection
#: streamed from memory, 0.5-0.7x over SmolLM2's whole decode), array-api-strict, JAX
#: bfloat16, torch float32 on a CPU, CUDA). Measured by ``benchmarks/quant_rule.py`` per
#: projection and ``benchmarks/quant_decode.py`` over a whole decode (one thread, interleaved
#: rounds, medians; the figures and the load are in ``benchmarks/README.md``) at SmolLM2-135M's
#: shapes, group 32.
KEEP_CODES_FROM: dict[tuple[str, str, str, int], int] = {
    # torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu): 1.1-1.7x the dense bfloat16 GEMV,
    # 8.4x on the 49152-row LM head; 2 and 3 bits run it as 4
    ("torch", "cpu", "bfloat16", 2): 0,
    ("torch", "cpu", "bfloat16", 3): 0,
    ("torch", "cpu", "bfloat16", 4): 0,
    # 5 to 8 bits: the same kernel on two nibble planes. One projection with its weight in
    # cache: 0.73-1.0x the dense GEMV, 1.8-1.9x on the LM head; SmolLM2 Q8_0's whole decode
    # (weights streamed from memory, as in every real model) kept quantized: 1.6x its floats
    ("torch", "cpu", "bfloat16", 5): 0,
    ("torch", "cpu", "bfloat16", 6): 0,
    ("torch", "cpu", "bfloat16", 8): 0,
    # torch float32: none. No torch CPU kernel multiplies group-wise codes by float32
    # activations at the dense GEMV's speed (the int4/int8 kernels' float32 loops are scalar on
    # x86: 2-5x slower than the dense floats; benchmarks/README.md, issue 21).
    # JAX float32: native/jax.py's jitted kernel (the codes unpacked and scaled in float32
    # inside the product's XLA computation). SmolLM2 Q4_1 (4-bit layers, Q8_0 head), whole
    # compiled decode with every matrix kept: 1.38x, 1.10x, 1.04x its floats in three runs
    # (load 5-11);
    # per projection the ratios do not compose (the first rule kept only the head: 0.75-0.91x).
    # bfloat16: 0.19x (5.4 against 28.6 tok/s): none.
    ("jax", "cpu", "float32", 4): 0,
    ("jax", "cpu", "float32", 8): 0,
    # mx.quantized_matmul on a CPU: none. float32 per projection 0.96-1.5x (4 and 8 bits, noisy:
    # MLX runs several threads), but SmolLM2 Q4_1's whole decode kept ran 0.75x and 0.86x its
    # floats in two runs (load 10-14; the 4-bit layers alone kept: 0.86x); bfloat16 0.04-0.16x
    # (at float32 through native/mlx.py: 0.75-1.3x, with a weight not rounded as dequantize's)
    # mx.quantized_matmul on Metal: mlx-lm's own decode path (not measured on this machine)
    ("mlx", "gpu", "float32", 4): 0,
    ("mlx", "gpu", "float32", 8): 0,
    ("mlx", "gpu", "bfloat16", 4): 0,
    ("mlx", "gpu", "bfloat16", 8): 0,
    ("mlx", "gpu", "float16", 4): 0,
    ("mlx", "gpu", "float16", 8): 0,
}


def device_kind(bk: Backend, x: Any) -> str:
    """``"cpu"`` or ``"gpu"`` (CUDA, Metal, MPS): where the array ``x`` of ``bk`` computes."""
    dev = x.device if isinstance(x, QuantizedWeight) else bk.device_of(x)
    text = str(getattr(dev, "type", None) or getattr(dev, "platform", None) or dev).lower()
    return "cpu" if "cpu" in text else "gpu"


def keeps_codes(
    backend: str | Backend,
    /,
    *,
    device: str,
    dtype: str,
    bits: int,
    rows: int,
    group_size: int = 32,
) -> bool:
    """Whether a weight of ``rows`` output rows, ``bits``-bit codes, multiplied by activations
    of ``dtype`` on ``device`` (``"cpu"``/``"gpu"``), decodes at least as fast kept quantized
    as dequantized (the rule of :data:`KEEP_CODES_FROM`).

    Parameters
    ----------
    backend : str or Backend
    device : {"cpu", "gpu"}
    dtype : str
        The activations' dtype name (``"float32"``, ``"bfloat16"``, ...).
    bits : int
    rows : int
        N of the ``(N, K)`` weight.
    group_size : int, default 32
        Groups of 16 (llama.cpp's Q6_K) are never kept: MLX's kernels and torch's int4 kernel
        take 32 or more, and the paths that take them ran slower than the floats on NumPy,
        torch and MLX (per decode projection: 0.07-0.75x at 8 bits through NumPy's and torch's
        byte paths, 0.01-0.23x at 6 bits through the portable paths; JAX's jitted kernel
        0.72-1.55x at 8 bits, a tie over Gemma 3's whole decode; ``benchmarks/README.md``).

    Returns
    -------
    bool
    """
    name = backend if isinstance(backend, str) else backend.name
    if device not in ("cpu", "gpu"):
        raise ValueError(f"keeps_codes: device must be 'cpu' or 'gpu', got {device!r}")
    start = KEEP_CODES_FROM.get((name, device, dtype, int(bits)))
    return start is not None and int(rows) >= start and int(group_size) >= 32


#: ``(backend, device kind)`` where ``pl.load(..., activations="auto")`` (the default) takes the
#: int8 mode for a quantized checkpoint: where a whole decode measured faster in it than in the
#: default float mode *and* its KL divergence from the float model on real text was no worse
#: than llama.cpp's own on the same file (docs/gguf.md, "8-bit activations"; the figures in
#: benchmarks/README.md). Elsewhere ``auto`` is ``"float"``. Empty for now: on NumPy and torch's
#: CPU the int8 mode decodes 2.1-2.6x faster with a KL divergence no worse than llama.cpp's
#: (SmolLM2 Q4_1, Q8_0), but reads a prompt at 0.64-0.71x the float mode's speed.
INT8_BY_DEFAULT: frozenset[tuple[str, str]] = frozenset()


def int8_by_default(backend: str, device: str | None = None) -> bool:
    """Whether ``activations="auto"`` is ``"int8"`` on ``backend`` (a name) and ``device``
    (``"cpu"`` or ``"gpu"``; ``None``: on any device of it): the rule of
    :data:`INT8_BY_DEFAULT`."""
    return any(b == backend and device in (None, d) for b, d in INT8_BY_DEFAULT)
