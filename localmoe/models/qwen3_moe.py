"""Qwen3-MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention with MoE MLPs.

Checkpoint facts (the Hub layout; transformers 5 writes it back on save): attention as dense Qwen3
(q/k/v/o without biases, per-head RMSNorm of q and k before RoPE), router `mlp.gate.weight` [E, D],
experts per id `mlp.experts.{e}.{gate,up,down}_proj.weight` (bf16, [I, D] / [D, I]). Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` stride, have a dense SiLU MLP instead.

Quirks, each covered by tests/models/test_qwen3_moe.py: softmax over all experts, top-k, the chosen
weights renormalised when `norm_topk_prob`; no shared expert; SwiGLU experts.
"""

from __future__ import annotations

import dataclasses

from localmoe.config import ModelSpec
from localmoe.engine.moe import expert_shapes
from localmoe.models import llama, register
from localmoe.models.base import ExpertTensors, ModelFamily, TensorMap, TensorRule
from localmoe.models.moe_config import require


def _experts(config: dict) -> int:
    """`num_experts` on the Hub; transformers 5 writes `num_local_experts`."""
    return int(config.get("num_experts") or require(config, "num_local_experts"))


def _moe_layer(config: dict, i: int) -> bool:
    step = config.get("decoder_sparse_step", 1) or 1
    return i not in (config.get("mlp_only_layers") or ()) and _experts(config) > 0 and (i + 1) % step == 0


def spec_from_hf(config: dict) -> ModelSpec:
    dense = llama.spec_from_hf({**config, "model_type": "qwen3"})  # the attention is Qwen3's
    layers = dense.num_layers
    return dataclasses.replace(
        dense, model_type="qwen3_moe", family="qwen3_moe",
        mlp_kinds=tuple("moe" if _moe_layer(config, i) else "dense" for i in range(layers)),
        num_experts=_experts(config), num_experts_per_tok=require(config, "num_experts_per_tok"),
        moe_intermediate_size=require(config, "moe_intermediate_size"),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)), scoring_func="softmax", expert_act="swiglu",
    )


_PROJECTIONS = ("gate", "up", "down")

HF_TENSORS = TensorMap(
    rules=(
        *llama.HF_TENSORS.rules,
        TensorRule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        *(TensorRule(f"model.layers.{{i}}.mlp.experts.{{e}}.{p}_proj.weight", f"layers.{{i}}.mlp.experts.{{e}}.{p}.weight")
          for p in _PROJECTIONS),
    ),
    ignore=llama.HF_TENSORS.ignore,
)


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    shapes = llama.expected_shapes(spec)
    D = spec.hidden_size
    for i in spec.moe_layers():
        m = f"layers.{i}.mlp."
        for p in _PROJECTIONS:
            del shapes[f"{m}{p}_proj.weight"]
        shapes |= {m + "router.weight": (spec.num_experts, D)} | expert_shapes(spec, m, D)
    return shapes


FAMILY = register(ModelFamily(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    spec_from_hf=spec_from_hf,
    hf_tensors=HF_TENSORS,
    expected_shapes=expected_shapes,
   
    experts=ExpertTensors("bf16", {p: f"model.layers.{{i}}.mlp.experts.{{e}}.{p}_proj.weight" for p in _PROJECTIONS}),
))
