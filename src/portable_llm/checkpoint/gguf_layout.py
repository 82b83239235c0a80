"""The layout of a GGUF file checked against its size before anything is read from it.

A GGUF header is a list of counts and lengths (keys, values, array items, tensors, dimensions,
offsets), each of which a hostile file can set to anything: an array of 2**40 items in a file
of a few hundred bytes, a tensor whose data lies past the end. :func:`check_gguf_layout` walks
the header with :mod:`struct` (no allocation beyond one value at a time) and refuses, with a
:class:`~portable_llm.checkpoint.files.CheckpointError` naming the file, the byte offset and the
field, every count that the bytes left in the file cannot hold, every tensor whose data does not
lie inside the file, unknown value and tensor types, invalid UTF-8 in keys and names, duplicate
keys or tensors, and more than :data:`MAX_METADATA_VALUES` metadata values. Only then does the
``gguf`` package's ``GGUFReader`` parse the file, so its work and memory are bounded by the
file's size.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from portable_llm.checkpoint.files import CheckpointError

__all__ = ["MAX_METADATA_VALUES", "check_gguf_layout"]

#: The most metadata values (array items included) a GGUF file may hold. Gemma 3's file, with
#: a 262,144-token vocabulary, holds about 800,000; ``GGUFReader`` keeps a few NumPy objects per
#: value, so this bounds its memory at about a gigabyte whatever the file says.
MAX_METADATA_VALUES = 4_000_000
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 4  # arrays of arrays
_ARRAY, _STRING = 9, 8
# GGUFValueType -> (struct code, size in bytes); strings and arrays are read apart.
_SCALARS = {
    0: ("B", 1),
    1: ("b", 1),
    2: ("H", 2),
    3: ("h", 2),
    4: ("I", 4),
    5: ("i", 4),
    6: ("f", 4),
    7: ("?", 1),
    10: ("Q", 8),
    11: ("q", 8),
    12: ("d", 8),
}


class _Walk:
    """A cursor over the file's bytes that refuses to step past the end."""

    def __init__(self, data: mmap.mmap | bytes, file: Path, order: str) -> None:
        self.data, self.file, self.order, self.at = data, file, order, 0
        self.values = 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"load: {str(self.file)!r} ({len(self.data)} bytes) is not a valid GGUF file: "
            f"{what} (at byte {self.at})"
        )

    def left(self) -> int:
        return len(self.data) - self.at

    def scalar(self, code: str, what: str) -> int | float | bool:
        size = struct.calcsize(code)
        if size > self.left():
            raise self.fail(f"the file ends inside {what}")
        value: int | float | bool
        (value,) = struct.unpack_from(self.order + code, self.data, self.at)
        self.at += size
        return value

    def count(self, what: str, each: int) -> int:
        """A uint64 count of items of at least ``each`` bytes, checked against the bytes left."""
        n = int(self.scalar("Q", what))
        left = self.left()
        if n * each > left:
            raise self.fail(f"{what} is {n}, but the {left} bytes left hold at most {left // each}")
        return n

    def string(self, what: str) -> bytes:
        n = self.count(f"the length of {what}", 1)
        raw = bytes(self.data[self.at : self.at + n])
        self.at += n
        return raw

    def text(self, what: str) -> str:
        raw = self.string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def value(self, kind: int, what: str, depth: int = 0) -> None:
        """Step over one value of GGUFValueType ``kind``."""
        self.values += 1
        if self.values > MAX_METADATA_VALUES:
            raise self.fail(f"more than {MAX_METADATA_VALUES} metadata values")
        if kind in _SCALARS:
            self.scalar(_SCALARS[kind][0], what)
        elif kind == _STRING:
            self.string(what)
        elif kind == _ARRAY:
            if depth >= _MAX_NESTING:
                raise self.fail(f"{what} nests arrays more than {_MAX_NESTING} deep")
            item = int(self.scalar("I", f"the item type of {what}"))
            if item not in _SCALARS and item not in (_STRING, _ARRAY):
                raise self.fail(f"{what} has items of unknown type {item}")
            each = _SCALARS[item][1] if item in _SCALARS else 8 if item == _STRING else 12
            n = self.count(f"the item count of {what}", each)
            if self.values + n > MAX_METADATA_VALUES:
                raise self.fail(f"{what} has {n} items (at most {MAX_METADATA_VALUES} values)")
            if item in _SCALARS:
                self.values += n
                self.at += n * each
            else:
                for _ in range(n):
                    self.value(item, what, depth + 1)
        else:
            raise self.fail(f"{what} has unknown value type {kind}")


def check_gguf_layout(file: Path, /) -> None:
    """Refuse a GGUF file whose header does not fit in the file (see the module docstring).

    Raises
    ------
    CheckpointError
        Not GGUF (magic, version), a count or length beyond the bytes left, an unknown value
        or tensor type, a tensor of more than 4 dimensions or whose data lies outside the
        file, invalid UTF-8 in a key or tensor name, a duplicate key or tensor, a bad
        ``general.alignment``, too many metadata values: the message names the file, the byte
        offset and the field.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        with file.open("rb") as f:
            size = file.stat().st_size
            data: mmap.mmap | bytes = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            )
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"load: cannot read {str(file)!r}: {exc}") from None
    try:
        _walk_layout(_Walk(data, file, "<"), GGML_QUANT_SIZES, GGMLQuantizationType)
    finally:
        if isinstance(data, mmap.mmap):
            data.close()


def _walk_layout(walk: _Walk, sizes: Any, types: Any) -> None:
    data = walk.data
    if walk.left() < 4 or bytes(data[:4]) != b"GGUF":
        raise walk.fail("it does not start with the GGUF magic bytes")
    walk.at = 4
    version = int(walk.scalar("I", "the version"))
    if version & 0xFFFF == 0:  # written on a big-endian machine (GGUFReader's rule)
        walk.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        raise walk.fail(f"version {version} (GGUF versions 2 and 3 are read)")
    n_tensors = walk.count("the tensor count", 24)
    n_kv = walk.count("the metadata key count", 13)
    keys: set[str] = set()
    alignment = 32
    for _ in range(n_kv):
        key = walk.text("a metadata key")
        if key in keys:
            raise walk.fail(f"metadata key {key[:80]!r} appears twice")
        keys.add(key)
        kind = int(walk.scalar("I", f"the type of {key[:80]}"))
        start = walk.at
        walk.value(kind, f"metadata {key[:80]}")
        if key == "general.alignment":
            if kind != 4:
                raise walk.fail("general.alignment must be a uint32")
            alignment = struct.unpack_from(walk.order + "I", data, start)[0]
            if alignment == 0 or alignment & (alignment - 1) or alignment > 1 << 20:
                raise walk.fail(f"general.alignment {alignment} is not a power of two <= 2**20")
    names: set[str] = set()
    spans: list[tuple[str, int, int]] = []
    for _ in range(n_tensors):
        name = walk.text("a tensor name")
        if name in names:
            raise walk.fail(f"tensor {name[:80]!r} appears twice")
        names.add(name)
        n_dims = int(walk.scalar("I", f"the dimension count of tensor {name[:80]}"))
        if not 1 <= n_dims <= _MAX_DIMS:
            raise walk.fail(f"tensor {name[:80]} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        dims = [int(walk.scalar("Q", f"the shape of tensor {name[:80]}")) for _ in range(n_dims)]
        kind = int(walk.scalar("I", f"the type of tensor {name[:80]}"))
        offset = int(walk.scalar("Q", f"the data offset of tensor {name[:80]}"))
        try:
            block, nbytes = sizes[types(kind)]
        except (ValueError, KeyError):
            raise walk.fail(f"tensor {name[:80]} has unknown type {kind}") from None
        elements = 1
        for n in dims:
            elements *= n
        if dims[0] % block:
            raise walk.fail(
                f"tensor {name[:80]} has rows of {dims[0]} values, not a multiple of its "
                f"type's block of {block}"
            )
        spans.append((name, offset, elements // block * nbytes))
    start = walk.at + (-walk.at) % alignment
    for name, offset, nbytes in spans:
        if start + offset + nbytes > len(data):
            raise walk.fail(
                f"tensor {name[:80]}'s data ({nbytes} bytes at {start + offset}) lies past the "
                "end of the file (a truncated file?)"
            )
