"""GLM-5 (`glm_moe_dsa`, transformers `GlmMoeDsaForCausalLM`), bf16: DeepSeek-V3.2's layout
(families/deepseek_v32.py) with GLM's tokenizer, one expert group, plain RoPE (no YaRN), and
`indexer_types`: "shared" layers carry no `self_attn.indexer.*` (they reuse the previous full
layer's selection). No MTP layer (`num_nextn_predict_layers` 0).
"""

from __future__ import annotations

from typing import Any

from localmoe.testing.families.deepseek_v32 import SIZES as DEEPSEEK_SIZES
from localmoe.testing.families.deepseek_v32 import build as build_deepseek
from localmoe.testing.families.glm5_next import TOKENIZER
from localmoe.testing.plan import CheckpointGenerator, TensorSpec
from localmoe.testing.tokenizer import TokenizerLayout

# full, shared, shared, full, shared: a shared layer right after a full one and after another shared one
SIZES = {name: dict(d, layers=5 if name == "tiny" else d["layers"], n_group=1, topk_group=1)
         for name, d in DEEPSEEK_SIZES.items()}


def indexer_types(layers: int) -> list[str]:
    return ["full" if i % 3 == 0 else "shared" for i in range(layers)]


def build(d: dict[str, Any], tok: TokenizerLayout) -> tuple[dict[str, Any], list[TensorSpec]]:
    config, tensors = build_deepseek(d, tok)
    types = indexer_types(d["layers"])
    shared = {f"model.layers.{i}.self_attn.indexer." for i, t in enumerate(types) if t == "shared"}
    config.update(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", indexer_types=types,
                  rope_theta=1000000, rms_norm_eps=1e-5)
    del config["rope_scaling"]
    return config, [t for t in tensors if not any(t.name.startswith(p) for p in shared)]


FAMILY = CheckpointGenerator("glm_moe_dsa", build, SIZES, TOKENIZER)
