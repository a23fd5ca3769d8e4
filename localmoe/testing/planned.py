"""A generated checkpoint's tensors computed on demand, never written: the bytes `write_checkpoint` would write,
for a consumer that reads each tensor once (localmoe's GGUF writer of a `large` model, whose Hugging Face shards
would take ~10 GB of disk for a file of 3)."""

from __future__ import annotations

import numpy as np
import torch

from localmoe.testing.random_data import tensor_chunks
from localmoe.testing.write import plan_checkpoint

_DTYPES = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16),
           "BF16": (np.uint16, torch.bfloat16), "U8": (np.uint8, torch.uint8)}


class PlannedCheckpoint:
    """`keys()` and `tensor(name)` of the checkpoint write_checkpoint(family, ..., size, seed) writes (as
    store.safetensors.SafetensorsCheckpoint reads them), each tensor generated when asked for."""

    def __init__(self, family: str, size: str, seed: int = 0):
        self.specs = {t.name: t for t in plan_checkpoint(family, size).tensors}
        self.seed = seed

    def keys(self) -> list[str]:
        return list(self.specs)

    def tensor(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        np_dtype, dtype = _DTYPES[spec.dtype]
        values = np.concatenate([np.frombuffer(chunk.tobytes(), np_dtype)
                                 for chunk in tensor_chunks(self.seed, name, spec.dtype, spec.shape, spec.init)])
        return torch.from_numpy(values.view(np.int16) if dtype == torch.bfloat16 else values).view(dtype).reshape(spec.shape)
