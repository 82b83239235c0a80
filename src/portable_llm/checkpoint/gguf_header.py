"""A GGUF file's header, checked against the file's size and read in one pass.

A GGUF header is a list of counts and lengths (keys, values, array items, tensors, dimensions,
offsets), each of which a hostile file can set to anything: an array of 2**40 items in a file
of a few hundred bytes, a tensor whose data lies past the end. :func:`read_gguf_header` walks
the header with :mod:`struct` and refuses, with a
:class:`~portable_llm.checkpoint.files.CheckpointError` naming the file, the byte offset and the
field, every count that the bytes left in the file cannot hold, every tensor whose data does not
lie inside the file, unknown value and tensor types, invalid UTF-8 in keys and names, duplicate
keys or tensors, and more than :data:`MAX_METADATA_VALUES` metadata values; each count is
checked before anything of that size is read, so the work and memory are bounded by the file's
size. The same walk reads the values (arrays of numbers in one ``numpy.frombuffer`` each) and
the tensors' places in the memory-mapped file: a 262,144-token vocabulary's header (Gemma 3)
reads in well under a second, where the ``gguf`` package's ``GGUFReader`` builds a few NumPy
objects per value (about 10 s for that file). The ``gguf`` package still names the tensor
types (``GGML_QUANT_SIZES``).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from portable_llm.checkpoint.files import CheckpointError

__all__ = ["MAX_METADATA_VALUES", "GGUFHeader", "GGUFTensor", "Undecodable", "read_gguf_header"]

#: The most metadata values (array items included) a GGUF file may hold. Gemma 3's file, with
#: a 262,144-token vocabulary, holds about 800,000; each becomes a Python object (a str, int or
#: float), so this bounds the header's memory at a few hundred megabytes whatever the file says.
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
_NUMPY = {"B": "u1", "b": "i1", "H": "u2", "h": "i2", "I": "u4", "i": "i4", "f": "f4"}
_NUMPY |= {"?": "?", "Q": "u8", "q": "i8", "d": "f8"}


@dataclass(frozen=True)
class Undecodable:
    """A metadata string (or an array holding one) that is not valid UTF-8: refused only
    where it is read (:class:`~portable_llm.checkpoint.gguf_meta.GGUFMetadata`)."""

    error: str


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: ``shape`` in ggml's order (``ne``, innermost first),
    ``kind`` its ggml type name (``"Q4_1"``, ``"F32"``), ``data`` its bytes (uint8, a view of
    the memory-mapped file: nothing is read until it is used)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    n_elements: int
    data: np.ndarray


@dataclass(frozen=True)
class GGUFHeader:
    """What :func:`read_gguf_header` read: the metadata values (``str``, ``int``, ``float``,
    ``bool``, lists of them, or :class:`Undecodable`) and the tensors, in file order."""

    fields: dict[str, Any]
    tensors: dict[str, GGUFTensor]


class _Walk:
    """A cursor over the file's bytes (little-endian) that refuses to step past the end."""

    def __init__(self, data: mmap.mmap | bytes, file: Path) -> None:
        self.data, self.file, self.at = data, file, 0
        self.values = 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"load: {str(self.file)!r} ({len(self.data)} bytes) is not a valid GGUF file: "
            f"{what} (at byte {self.at})"
        )

    def left(self) -> int:
        return len(self.data) - self.at

    def scalar(self, code: str, what: str) -> Any:
        size = struct.calcsize(code)
        if size > self.left():
            raise self.fail(f"the file ends inside {what}")
        (value,) = struct.unpack_from("<" + code, self.data, self.at)
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

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        """Read one value of GGUFValueType ``kind``."""
        self.values += 1
        if self.values > MAX_METADATA_VALUES:
            raise self.fail(f"more than {MAX_METADATA_VALUES} metadata values")
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind][0], what)
        if kind == _STRING:
            raw = self.string(what)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return Undecodable(str(exc))
        if kind != _ARRAY:
            raise self.fail(f"{what} has unknown value type {kind}")
        if depth >= _MAX_NESTING:
            raise self.fail(f"{what} nests arrays more than {_MAX_NESTING} deep")
        item = int(self.scalar("I", f"the item type of {what}"))
        if item not in _SCALARS and item not in (_STRING, _ARRAY):
            raise self.fail(f"{what} has items of unknown type {item}")
        each = _SCALARS[item][1] if item in _SCALARS else 8 if item == _STRING else 12
        n = self.count(f"the item count of {what}", each)
        if self.values + n > MAX_METADATA_VALUES:
            raise self.fail(f"{what} has {n} items (at most {MAX_METADATA_VALUES} values)")
        if item in _SCALARS:  # the count is checked against the bytes left: one read
            self.values += n
            dtype = np.dtype("<" + _NUMPY[_SCALARS[item][0]])
            items = np.frombuffer(self.data, dtype, count=n, offset=self.at).tolist()
            self.at += n * each
            return items
        out = [self.value(item, what, depth + 1) for _ in range(n)]
        bad = next((v for v in out if isinstance(v, Undecodable)), None)
        return out if bad is None else bad


def read_gguf_header(file: Path, /) -> GGUFHeader:
    """Read a GGUF file's header, refusing one that does not fit in the file (see the module
    docstring); the tensors are views of the memory-mapped file.

    Raises
    ------
    CheckpointError
        Not GGUF (magic, version), a big-endian file, a count or length beyond the bytes
        left, an unknown value or tensor type, a tensor of more than 4 dimensions or whose
        data lies outside the file, invalid UTF-8 in a key or tensor name, a duplicate key or
        tensor, a bad ``general.alignment``, too many metadata values: the message names the
        file, the byte offset and the field.
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
    # the tensors are views of ``data``: the mapping closes when the last of them is freed
    return _read(_Walk(data, file), GGML_QUANT_SIZES, GGMLQuantizationType)


def _read(walk: _Walk, sizes: Any, types: Any) -> GGUFHeader:
    data = walk.data
    if walk.left() < 4 or bytes(data[:4]) != b"GGUF":
        raise walk.fail("it does not start with the GGUF magic bytes")
    walk.at = 4
    version = int(walk.scalar("I", "the version"))
    if version & 0xFFFF == 0:  # written on a big-endian machine (GGUFReader's rule)
        raise walk.fail(
            "it was written big-endian (llama.cpp's --bigendian); portable_llm reads "
            "little-endian GGUF files"
        )
    if version not in (2, 3):
        raise walk.fail(f"version {version} (GGUF versions 2 and 3 are read)")
    n_tensors = walk.count("the tensor count", 24)
    n_kv = walk.count("the metadata key count", 13)
    fields: dict[str, Any] = {}
    alignment = 32
    for _ in range(n_kv):
        key = walk.text("a metadata key")
        if key in fields:
            raise walk.fail(f"metadata key {key[:80]!r} appears twice")
        kind = int(walk.scalar("I", f"the type of {key[:80]}"))
        fields[key] = walk.value(kind, f"metadata {key[:80]}")
        if key == "general.alignment":
            if kind != 4:
                raise walk.fail("general.alignment must be a uint32")
            alignment = fields[key]
            if alignment == 0 or alignment & (alignment - 1) or alignment > 1 << 20:
                raise walk.fail(f"general.alignment {alignment} is not a power of two <= 2**20")
    infos: list[tuple[str, tuple[int, ...], str, int, int, int]] = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = walk.text("a tensor name")
        if name in names:
            raise walk.fail(f"tensor {name[:80]!r} appears twice")
        names.add(name)
        n_dims = int(walk.scalar("I", f"the dimension count of tensor {name[:80]}"))
        if not 1 <= n_dims <= _MAX_DIMS:
            raise walk.fail(f"tensor {name[:80]} has {n_dims} dimensions (1 to {_MAX_DIMS})")
        dims = tuple(
            int(walk.scalar("Q", f"the shape of tensor {name[:80]}")) for _ in range(n_dims)
        )
        kind = int(walk.scalar("I", f"the type of tensor {name[:80]}"))
        offset = int(walk.scalar("Q", f"the data offset of tensor {name[:80]}"))
        try:
            ggml = types(kind)
            block, nbytes = sizes[ggml]
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
        infos.append((name, dims, ggml.name, elements, offset, elements // block * nbytes))
    start = walk.at + (-walk.at) % alignment
    for name, _, _, _, offset, nbytes in infos:
        if start + offset + nbytes > len(data):
            raise walk.fail(
                f"tensor {name[:80]}'s data ({nbytes} bytes at {start + offset}) lies past the "
                "end of the file (a truncated file?)"
            )
    whole = np.frombuffer(data, np.uint8) if infos else np.zeros(0, np.uint8)
    tensors = {
        name: GGUFTensor(name, dims, kind, elements, whole[start + at : start + at + nbytes])
        for name, dims, kind, elements, at, nbytes in infos
    }
    return GGUFHeader(fields, tensors)
