"""What a test checkpoint holds, computed without writing anything.

A family's `build(dims)` returns the config.json dict and the tensor list; `plan()` adds
the tokenizer-independent bookkeeping (shards, byte and parameter counts) that both the
writer and the size tests use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from localmoe.errors import LocalMoEError
from localmoe.store.safetensors_writer import DTYPE_SIZES, TensorEntry, alignment_order
from localmoe.testing.random_data import Init
from localmoe.testing.tokenizer import TokenizerLayout

GB = 10**9


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One stored tensor.

    expert: part of a routed expert (what the pager moves); linear: the weight of an
    `nn.Linear` module (compressed-tensors ignore lists name these); params_per_element:
    logical parameters per stored element (2 for packed FP4 bytes, 0 for scales).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    init: Init
    expert: bool = False
    linear: bool = False
    params_per_element: int = 1

    @property
    def entry(self) -> TensorEntry:
        return TensorEntry(self.name, self.dtype, self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    @property
    def params(self) -> int:
        return math.prod(self.shape) * self.params_per_element


@dataclass(slots=True)
class Plan:
    """A checkpoint before it is written: config, tensors and their placement in shards."""

    family: str
    size: str
    config: dict[str, Any]
    tensors: list[TensorSpec]
    shards: list[list[TensorSpec]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def expert_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.expert)

    @property
    def params(self) -> int:
        return sum(t.params for t in self.tensors)

    @property
    def shard_names(self) -> list[str]:
        n = len(self.shards)
        if n == 1:
            return ["model.safetensors"]
        return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    def weight_map(self) -> dict[str, str]:
        return {t.name: file for file, shard in zip(self.shard_names, self.shards) for t in shard}


def assign_shards(tensors: list[TensorSpec], shard_bytes: int | None) -> list[list[TensorSpec]]:
    """Greedy shards of at most `shard_bytes` (one per tensor larger than that), each in
    alignment order; `None` puts everything in one file."""
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"tensor {dup!r} is planned twice")
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for t in tensors:
        if shard_bytes is not None and shards[-1] and used + t.nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += t.nbytes
    return [alignment_order(s) for s in shards]


@dataclass(frozen=True, slots=True)
class CheckpointGenerator:
    """A model family's test-checkpoint recipe.

    build(dims, tokenizer) -> (config.json dict, tensors); sizes: the dims of each size;
    shard_bytes: the default shard limit of each size (None: one file).
    """

    name: str
    build: Callable[[dict[str, Any], TokenizerLayout], tuple[dict[str, Any], list[TensorSpec]]]
    sizes: dict[str, dict[str, Any]]
    tokenizer: TokenizerLayout
    shard_bytes: dict[str, int | None] = field(
        default_factory=lambda: {"tiny": None, "small": 2 * GB, "large": 2 * GB})
    # other JSON files of the checkpoint from a size's dims, name -> content (an image processor's
    # preprocessor_config.json)
    files: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    def plan(self, size: str = "tiny", shard_bytes: int | None | str = "default") -> Plan:
        if size not in self.sizes:
            raise LocalMoEError(f"test family {self.name} has no size {size!r}; choose one of {', '.join(self.sizes)}")
        config, tensors = self.build(dict(self.sizes[size]), self.tokenizer)
        limit = self.shard_bytes.get(size) if shard_bytes == "default" else shard_bytes
        return Plan(self.name, size, config, tensors, assign_shards(tensors, limit))
