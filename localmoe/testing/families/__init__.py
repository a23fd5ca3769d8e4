"""The test-checkpoint families, by name (the config's `model_type`)."""

from __future__ import annotations

from localmoe.testing.families import (
    deepseek_v32,
    glm4_moe,
    glm5_next,
    glm_moe_dsa,
    gpt_oss,
    kimi_k3,
    kimi_k25,
    kimi_linear,
    qwen3_moe,
    qwen3_next,
    qwen3_vl_moe,
)
from localmoe.testing.plan import CheckpointGenerator

FAMILIES: dict[str, CheckpointGenerator] = {
    f.name: f for f in (kimi_linear.FAMILY, gpt_oss.FAMILY, qwen3_next.FAMILY, deepseek_v32.FAMILY, glm5_next.FAMILY,
                        kimi_k3.FAMILY, qwen3_moe.FAMILY, deepseek_v32.V3, kimi_k25.FAMILY, glm4_moe.FAMILY,
                        qwen3_vl_moe.FAMILY, glm_moe_dsa.FAMILY)
}
