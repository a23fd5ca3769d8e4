"""Split GGUF files (`model-00001-of-00003.gguf`, as llama.cpp's gguf-split and convert_hf_to_gguf
--split-max-* write them): any part names the whole model, every part is read.

The first part holds the model's metadata and each part its own tensor infos, offsets counted from
its own data section, plus `split.no`, `split.count` and `split.tensors.count`. `open_gguf(path)`
returns a `GGUFFile` for a single file and a `GGUFSplit` for a split one; both answer the same
questions (metadata, tensor names, info, raw bytes, dequantised tensors, `file_of`), so the loader,
`inspect` and `convert` never ask which it is. The merged metadata drops the `split.*` keys: a split
model reads exactly as its unsplit file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from localmoe.errors import CheckpointError
from localmoe.store.gguf import GGUFFile, GGUFTensorInfo

SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def split_parts(path: str | os.PathLike) -> list[Path] | None:
    """All parts of the split GGUF that `path` (any part) belongs to, in order; None for a file whose
    name is not `<stem>-0000N-of-0000M.gguf`. CheckpointError naming the first missing part."""
    path = Path(path)
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return None
    count = int(match["count"])
    if count < 1 or not 1 <= int(match["no"]) <= count:
        raise CheckpointError(f"{path}: a split GGUF name counts parts 1 to {count}, not part {int(match['no'])}")
    parts = [path.with_name(f"{match['stem']}-{n:05d}-of-{count:05d}.gguf") for n in range(1, count + 1)]
    missing = [p for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"{path} is part of a GGUF split into {count} files, and part {missing[0].name} is "
                              f"missing{f' (with {len(missing) - 1} more)' if len(missing) > 1 else ''}; download "
                              f"every part into {path.parent}")
    return parts


class GGUFSplit:
    """A model split over several GGUF files, read as one (the interface of `GGUFFile`)."""

    def __init__(self, parts: list[Path]) -> None:
        self.parts: list[GGUFFile] = []
        try:
            for path in parts:
                self.parts.append(GGUFFile(path))
            self._check()
        except CheckpointError:
            self.close()
            raise
        first = self.parts[0]
        self.path, self.version = first.path, first.version
        self.metadata = {k: v for k, v in first.metadata.items() if k not in SPLIT_KEYS}
        self._owner = {name: part for part in self.parts for name in part.tensor_names()}

    def _check(self) -> None:
        count = len(self.parts)
        seen: dict[str, Path] = {}
        for no, part in enumerate(self.parts):
            md = part.metadata
            if md.get("split.count") != count or md.get("split.no") != no:
                raise CheckpointError(f"{part.path}: its metadata says part {md.get('split.no')} of "
                                      f"{md.get('split.count')}, but its name says part {no} (0-based) of {count}; "
                                      f"the parts belong to different downloads")
            for name in part.tensor_names():
                if name in seen:
                    raise CheckpointError(f"{part.path}: tensor {name!r} is also in {seen[name].name}; the parts "
                                          f"belong to different splits")
                seen[name] = part.path
        want = self.parts[0].metadata.get("split.tensors.count")
        if want is not None and want != len(seen):
            raise CheckpointError(f"{self.parts[0].path}: the split holds {want} tensors, its {count} parts "
                                  f"{len(seen)}; a part is from another download")

    @property
    def files(self) -> list[Path]:
        """Every part, in order."""
        return [part.path for part in self.parts]

    @property
    def architecture(self) -> str:
        return self.parts[0].architecture

    def tensor_names(self) -> list[str]:
        """Tensor names in file order, part after part."""
        return list(self._owner)

    def keys(self) -> list[str]:
        return self.tensor_names()

    def __contains__(self, name: object) -> bool:
        return name in self._owner

    def __len__(self) -> int:
        return len(self._owner)

    def _part(self, name: str) -> GGUFFile:
        try:
            return self._owner[name]
        except KeyError:
            raise CheckpointError(f"{self.path} (split in {len(self.parts)} parts) has no tensor {name!r}") from None

    def file_of(self, name: str) -> Path:
        """The part holding tensor `name` (its `info().offset` is within that file)."""
        return self._part(name).path

    def info(self, name: str) -> GGUFTensorInfo:
        return self._part(name).info(name)

    def raw(self, name: str) -> torch.Tensor:
        return self._part(name).raw(name)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._part(name).tensor(name, dtype)

    def close(self) -> None:
        for part in self.parts:
            part.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFSplit({str(self.path)!r}, {len(self.parts)} parts, {len(self._owner)} tensors)"


def open_gguf(path: str | os.PathLike) -> GGUFFile | GGUFSplit:
    """The GGUF model at `path`: one file, or every part of the split it belongs to. A file whose
    metadata says it is one of several parts but whose name does not follow llama.cpp's
    `<stem>-0000N-of-0000M.gguf` is refused (its other parts cannot be found)."""
    parts = split_parts(path)
    if parts is not None:
        return GGUFSplit(parts) if len(parts) > 1 else GGUFFile(parts[0])
    gguf = GGUFFile(path)
    count = gguf.metadata.get("split.count", 1)
    if count != 1:
        gguf.close()
        raise CheckpointError(f"{path} is part {gguf.metadata.get('split.no', 0) + 1} of a GGUF split into {count} "
                              f"files, but its name is not <name>-0000N-of-{count:05d}.gguf; give the parts "
                              f"their original names")
    return gguf
