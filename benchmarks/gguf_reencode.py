"""Re-encode a GGUF file's matrices as another ggml type with the ``gguf`` package (issue 21's
same-weights comparison: the SmolLM2 Q4_1 file as Q8_0 and as F32).

Every tensor is decoded to float32 (``gguf.quants.dequantize``); matrices are then written as
``--type`` (``gguf.quants.quantize``; F32 writes the floats), vectors as F32; the metadata is
copied as it is.

    python benchmarks/gguf_reencode.py SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2.Q8_0.gguf \
        --type Q8_0
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np


def reencode(src: Path, dst: Path, kind: str) -> None:
    """Write ``src``'s tensors to ``dst`` with matrices as ggml type ``kind``."""
    qtype = gguf.GGMLQuantizationType[kind]
    reader = gguf.GGUFReader(src)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    writer = gguf.GGUFWriter(dst, str(arch.contents()) if arch else "llama")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if w.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--type", default="Q8_0", help="ggml type of the matrices (Q8_0, F32, ...)")
    args = ap.parse_args()
    reencode(args.src, args.dst, args.type)


if __name__ == "__main__":
    main()
