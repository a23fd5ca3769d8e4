"""Layer kinds, one file each: its `Config`, its tensors' shapes (`tensors`) and its construction from the
loader's checked weights (`build`), on a device."""

from __future__ import annotations

import torch


def on_device(tensor, device: str = "cpu"):
    """`tensor` on `device`; None stays None, and on the CPU every weight stays the object the loader gave
    (zero-copy views of the file, GGUF blocks). Elsewhere GGUF blocks (`BlockQuantized`) become their fp32
    dequantisation there: the GGML block kernels are CPU kernels."""
    if tensor is None or str(device) == "cpu":
        return tensor
    return tensor.float().to(device) if not isinstance(tensor, torch.Tensor) else tensor.to(device)
