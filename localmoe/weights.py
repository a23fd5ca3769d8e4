"""The canonical weights a family builds its model from (`load._canonical_weights`' result).

Checkpoint matrices arrive as zero-copy views of the file map, usually in bf16. The family
builders take fp32 (their transforms and build-time arithmetic are written for it) and `Linear`
then stores the engine's dtype. Converting every floating tensor up front held the fp32 copies of
all dense weights at once, on top of the model being built: for a bf16 model built in bf16, about
3x the dense bytes it ends up holding. Here a large floating tensor is converted and transformed
when the builder takes it (`Weights.__getitem__`, `get`, `pop`), so its fp32 copy lives only as long
as the builder holds it; a second take while the first is still alive returns the same tensor, so
tied weights stay one tensor. The values and their bits are the same as converting up front.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

MIN_DEFERRED_ELEMENTS = 1 << 16  # smaller tensors (norms, biases, small matrices) are converted at once


class Deferred:
    """A floating checkpoint tensor, converted to fp32 and transformed when taken; `shape` is the
    transformed shape (from the transform run on a meta tensor)."""

    __slots__ = ("_live", "shape", "source", "spec", "transform")

    def __init__(self, source: torch.Tensor, transform: Callable | None, spec, shape: tuple[int, ...]):
        self.source, self.transform, self.spec, self.shape = source, transform, spec, shape
        self._live: weakref.ref | None = None

    def take(self) -> torch.Tensor:
        tensor = self._live() if self._live is not None else None
        if tensor is None:
            tensor = self.source.float()
            if self.transform is not None:
                tensor = self.transform(tensor, self.spec)
            self._live = weakref.ref(tensor)
        return tensor


def convert(tensor: torch.Tensor, transform: Callable | None, spec) -> torch.Tensor | Deferred:
    """A checkpoint tensor as the builders take it: integer tensors (MXFP4 codes and scales) as they
    are; small floating ones in fp32, transformed, now; large ones Deferred, unless their transform
    cannot run on a meta tensor (then now as well)."""
    if not tensor.is_floating_point():
        return tensor if transform is None else transform(tensor, spec)
    if tensor.dim() >= 2 and tensor.numel() >= MIN_DEFERRED_ELEMENTS:
        shape = _transformed_shape(tensor, transform, spec)
        if shape is not None:
            return Deferred(tensor, transform, spec, shape)
    tensor = tensor.float()
    return tensor if transform is None else transform(tensor, spec)


def _transformed_shape(tensor: torch.Tensor, transform: Callable | None, spec) -> tuple[int, ...] | None:
    """The shape `transform` gives `tensor`, from a meta tensor; None where it needs the data."""
    meta = torch.empty(tensor.shape, dtype=torch.float32, device="meta")
    if transform is None:
        return tuple(meta.shape)
    try:
        return tuple(transform(meta, spec).shape)
    except Exception:  # noqa: BLE001 -- a data-dependent transform: the caller converts it now
        return None


def _taken(value):
    return value.take() if isinstance(value, Deferred) else value


class Weights(dict):
    """Canonical name -> tensor, where Deferred values are converted when taken through [], get or pop
    (iterate the names and index: items() and values() would convert every tensor at once)."""

    def __getitem__(self, name: str) -> torch.Tensor:
        return _taken(super().__getitem__(name))

    def get(self, name: str, default=None):
        return _taken(super().get(name, default))

    def pop(self, name: str, *default):
        return _taken(super().pop(name, *default))

    def items(self):
        raise TypeError("Weights.items() would convert every tensor at once: iterate the names and index")

    def values(self):
        raise TypeError("Weights.values() would convert every tensor at once: iterate the names and index")

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape without converting it."""
        value = super().__getitem__(name)
        return value.shape if isinstance(value, Deferred) else tuple(value.shape)
