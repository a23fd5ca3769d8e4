"""Split a GGUF file into llama.cpp's `<stem>-0000N-of-0000M.gguf` parts, for tests and benchmarks.

The parts are written by the `gguf` package's own `GGUFWriter` (its `split_max_tensors`, what
convert_hf_to_gguf.py --split-max-tensors uses), from the file as `gguf.GGUFReader` reads it, so
neither side is localmoe's reader: metadata with its value types in the first part, `split.*` keys
in each, every tensor's bytes unchanged.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def split_gguf(src: Path, dst: Path, parts: int) -> list[Path]:
    """Write `src` as `parts` files named after `dst` (`dst.stem-00001-of-0000N.gguf`, ...) in
    `dst`'s folder; returns their paths in order."""
    return rewrite_gguf(src, dst, parts=parts)


def rewrite_gguf(src: Path, dst: Path, *, parts: int = 1, omit: tuple[str, ...] = (),
                 dequantize: tuple[str, ...] = ()) -> list[Path]:
    """`src` written again by GGUFWriter: split into `parts` files (1: one file at `dst`), without the
    tensors named in `omit` (a broken file, for error tests), tensors of the ggml types named in `dequantize`
    (e.g. "MXFP4") as F32 values by `gguf.quants.dequantize` (a file that computes the same function without
    quantised blocks). Returns the files written."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tensors = [t for t in reader.tensors if t.name not in omit]
    if not 1 <= parts <= len(tensors):
        raise ValueError(f"{src} has {len(tensors)} tensors: it cannot be split into {parts} parts")
    writer = gguf.GGUFWriter(dst, arch, split_max_tensors=math.ceil(len(tensors) / parts) if parts > 1 else 0)
    V = gguf.GGUFValueType
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header's own fields; the writer adds the architecture
        vtype = field.types[0]
        sub = field.types[-1] if vtype == V.ARRAY else None
        if sub == V.ARRAY:
            raise ValueError(f"{src}: nested array {key!r} is not copied by rewrite_gguf")
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in tensors:
        if t.tensor_type.name in dequantize:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            writer.add_tensor(t.name, values.reshape(tuple(int(n) for n in reversed(t.shape))))
            continue
        data = np.ascontiguousarray(t.data)
        # quantised data comes as bytes; float types in numpy order (ggml's ne reversed)
        raw_shape = None if data.dtype == np.uint8 else tuple(int(n) for n in reversed(t.shape))
        writer.add_tensor(t.name, data, raw_shape=raw_shape, raw_dtype=t.tensor_type)
    if len(writer.tensors) != parts:
        raise ValueError(f"{src}: the writer made {len(writer.tensors)} parts, not {parts}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(Path(dst))
