"""GLM-5-Next (`glm5_next`): KDA linear layers with a bounded delta gate, MLA layers with the DSA
indexer, sigmoid-routed MoE; its text config is `text_config`, the text tower under
`model.language_model.` (a vision tower under `model.visual.` is not read).

Read for `inspect` and `convert` only: the engine does not run it yet (its layers also carry
manifold hyper-connections over `hc_mult` residual streams and a k-pool compression of the
indexer keys, which no engine layer implements).
"""

from __future__ import annotations

from localmoe.config import ModelSpec
from localmoe.models import register
from localmoe.models.base import Family
from localmoe.models.deepseek_v32 import experts, moe_spec
from localmoe.models.moe_config import require


def glm5_spec(config: dict) -> ModelSpec:
    source = "config.json text_config"
    text = require(config, "text_config")
    kinds = {"linear_attention": "kda", "indexed_attention": "dsa", "full_attention": "mla"}
    mlp = {"dense": "dense", "sparse": "moe"}
    return moe_spec(text, "glm5_next", tuple(kinds[t] for t in require(text, "layer_types", source)),
                    tuple(mlp[t] for t in require(text, "mlp_layer_types", source)), source)


GLM5 = register(Family(name="glm5_next", model_types=("glm5_next",), gguf_architectures=(),
                       spec_from_hf=glm5_spec, experts=experts("model.language_model.")))
