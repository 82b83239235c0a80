"""The bit streams of MLX's affine format: ``bits``-bit codes packed into uint32 words.

The codes of a row are one little-endian bit stream: code ``k`` occupies bits ``bits*k ..
bits*k + bits - 1``, and stream bit ``b`` is bit ``b % 32`` of word ``b // 32``. For 2, 4 and 8
bits a code never straddles two words; for 3, 5 and 6 bits some do. The portable code unpacks
with shifts and masks on int32 (the uint32 words reinterpreted: every library wraps the
conversion, and torch has no shifts on uint32); the codes are exact whatever the int32's sign.
Used by the exact mode's kernels (:mod:`portable_llm.ops.quant.kernels`) and the 8-bit
activation mode (:mod:`portable_llm.ops.quant.int8`).
"""

from __future__ import annotations

from typing import Any

from portable_llm.core.arrays import creation_device, exact_divide

__all__ = ["exact_divide", "pack_codes", "unpack_codes"]  # exact_divide: from core.arrays


def _positions(bits: int) -> list[tuple[int, int]]:
    """(word, shift) of each of the 32 codes of one block of ``bits`` words."""
    return [divmod(bits * j, 32) for j in range(32)]


def unpack_codes(xp: Any, packed: Any, /, *, bits: int) -> Any:
    """uint32 words ``(.., W)`` -> int32 codes ``(.., W * 32 / bits)`` (any backend's arrays)."""
    words = xp.astype(packed, xp.int32)  # wraps: the bit pattern is kept
    mask = (1 << bits) - 1
    lead, w = tuple(packed.shape[:-1]), packed.shape[-1]
    if 32 % bits == 0:  # whole codes per word: code i of a word sits at bits*i
        # One broadcast shift (measured 2-4x faster on torch than a stack of 32/bits shifts,
        # whose last-axis stack writes with a stride).
        device = creation_device(packed)  # MLX: None; a JAX weight over a mesh: its mesh
        shifts = xp.arange(0, 32, bits, dtype=xp.int32, device=device)  # (32/bits,)
        codes = (words[..., None] >> shifts) & mask  # (.., W, 32/bits)
        return xp.reshape(codes, (*lead, w * 32 // bits))
    blocks = xp.reshape(words, (*lead, w // bits, bits))  # (.., W/bits, bits): 32 codes each
    parts = []
    for word, shift in _positions(bits):
        code = blocks[..., word] >> shift
        if shift + bits > 32:  # straddles: the high part is the low bits of the next word
            code = (code & ((1 << (32 - shift)) - 1)) | (blocks[..., word + 1] << (32 - shift))
        parts.append(code & mask)
    codes = xp.stack(parts, axis=-1)  # (.., W/bits, 32)
    return xp.reshape(codes, (*lead, w * 32 // bits))


def pack_codes(xp: Any, codes: Any, /, *, bits: int) -> Any:
    """int32 codes ``(.., K)`` in ``[0, 2**bits)`` -> uint32 words ``(.., K * bits / 32)``."""
    lead, k = tuple(codes.shape[:-1]), codes.shape[-1]
    if 32 % bits == 0:
        per = 32 // bits
        c = xp.reshape(codes, (*lead, k // per, per))  # (.., W, 32/bits)
        word = c[..., 0]
        for i in range(1, per):
            word = word | (c[..., i] << (bits * i))  # int32 wraps at bit 31: the bits are kept
        return xp.astype(word, xp.uint32)
    c = xp.reshape(codes, (*lead, k // 32, 32))  # (.., K/32, 32): one block of `bits` words each
    words: list[Any] = [None] * bits
    for j, (word, shift) in enumerate(_positions(bits)):
        low = c[..., j] << shift
        words[word] = low if words[word] is None else words[word] | low
        if shift + bits > 32:
            high = c[..., j] >> (32 - shift)
            words[word + 1] = high if words[word + 1] is None else words[word + 1] | high
    out = xp.stack(words, axis=-1)  # (.., K/32, bits)
    return xp.astype(xp.reshape(out, (*lead, k * bits // 32)), xp.uint32)
