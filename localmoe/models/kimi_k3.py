"""Kimi K3 (`kimi_k3`): Kimi-Linear's text model with K3's changes (MODELS.md).

Checkpoint facts: config under `text_config`; tensors prefixed `language_model.`; routed
experts in compressed-tensors `mxfp4-pack-quantized` (`w1/w3/w2.weight_packed` +
`weight_scale`, element 2i in the low nibble) over the latent width; layer lists 1-indexed.
"""

from __future__ import annotations

from localmoe.config import ModelSpec
from localmoe.models import register
from localmoe.models.base import ExpertTensors, Family
from localmoe.models.kimi_linear import text_spec
from localmoe.models.moe_config import require


def spec_from_hf(config: dict) -> ModelSpec:
    return text_spec(require(config, "text_config"), "kimi_k3", "kimi_k3", "config.json text_config")


_EXPERT = "language_model.model.layers.{i}.block_sparse_moe.experts.{e}"

FAMILY = register(Family(
    name="kimi_k3",
    model_types=("kimi_k3",),
    gguf_architectures=(),
    spec_from_hf=spec_from_hf,
    experts=ExpertTensors("compressed_tensors_mxfp4", {"gate": f"{_EXPERT}.w1", "up": f"{_EXPERT}.w3",
                                                       "down": f"{_EXPERT}.w2"}),
))
