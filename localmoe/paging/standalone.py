"""Build a model straight from a packed store with its experts paged (no resident copy).

A stop-gap for benchmarks and tests until `localmoe.load` opens packed stores: dense
tensors come from the store's shards through the family's tensor map; the routed-expert
tensors the builder expects are zero-stride placeholders (no memory) that the pager then
replaces (`use_experts`). Supports stores converted from HF checkpoints.
"""

from __future__ import annotations

import torch

from localmoe.config import EngineConfig
from localmoe.errors import CheckpointError
from localmoe.models import family_for_model_type
from localmoe.paging import PagingConfig, attach, make_pager
from localmoe.store.packed import PackedStore


def _placeholder(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    dtype = torch.uint8 if name.endswith((".packed", ".scales")) else torch.float32
    return torch.zeros((), dtype=dtype).expand(shape)


def build_paged(store: PackedStore | str, paging: PagingConfig, config: EngineConfig | None = None,
                lookahead: bool = True):
    """(model, pager) for a packed store: dense weights loaded, experts served by a Pager."""
    store = store if isinstance(store, PackedStore) else PackedStore(store)
    config = config or EngineConfig(dtype="float32")
    spec = store.spec
    family = family_for_model_type(spec.model_type, str(store.path))
    weights: dict[str, torch.Tensor] = {}
    for name in store.dense_names():
        resolved = family.hf_tensors.resolve(name)
        if resolved is None:
            continue
        canonical, transform = resolved
        t = store.dense(name)
        t = t.float() if t.is_floating_point() else t
        weights[canonical] = transform(t, spec) if transform is not None else t
    for canonical, shape in family.expected_shapes(spec).items():
        if canonical not in weights:
            if ".mlp.experts." not in canonical:
                raise CheckpointError(f"{store.path}: dense tensor {canonical!r} is missing")
            weights[canonical] = _placeholder(canonical, shape)
        elif tuple(weights[canonical].shape) != shape:
            raise CheckpointError(f"{store.path}: {canonical!r} has shape {tuple(weights[canonical].shape)}, "
                                  f"expected {shape}")
    model = family.build(spec, weights, config)
    pager = make_pager(store, paging)
    model.use_experts(pager)
    attach(model, pager, lookahead=lookahead)
    return model, pager
