"""What every memory-mapped weight-file reader shares: a name -> info table, zero-copy
byte views of the map, and closing that never unmaps under a live tensor."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch

from localmoe.errors import CheckpointError


class MappedFile:
    """Base of SafetensorsFile and GGUFFile. Subclasses set `path`, `_map` and `_infos`
    (name -> a record with `offset` (absolute) and `nbytes`)."""

    path: Path
    _map: mmap.mmap | None
    _infos: dict

    def keys(self) -> list[str]:
        """Tensor names, in file order."""
        return list(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str):
        """Where one tensor lives (see the subclass for the record's fields)."""
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path} has no tensor {name!r}") from None

    def _bytes(self, name: str) -> torch.Tensor:
        """The tensor's stored bytes: a zero-copy uint8 view [nbytes] of the map."""
        info = self.info(name)
        if self._map is None:
            raise CheckpointError(f"{self.path} is closed; open it again to read {name!r}")
        if info.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)  # frombuffer rejects empty ranges
        # via numpy, not torch.frombuffer: numpy holds a buffer export on the map, so the map
        # cannot be unmapped under a live tensor (torch.frombuffer holds only a reference)
        return torch.from_numpy(np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset))

    def close(self) -> None:
        """Release the map now if no tensor views it; otherwise when the last such tensor is freed."""
        m, self._map = self._map, None
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # live views hold exports; the map is unmapped with the last of them

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, {len(self._infos)} tensors)"
