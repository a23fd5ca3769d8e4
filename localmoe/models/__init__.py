"""Registry of model families, keyed by HF `model_type` and GGUF `general.architecture`."""

from __future__ import annotations

import importlib

from localmoe.errors import UnsupportedModelError
from localmoe.models.base import ModelFamily

_FAMILIES: dict[str, ModelFamily] = {}
# the modules of localmoe/models/ that define a family (the others are helpers they share)
BUILTIN = ("deepseek_v32", "glm4_moe", "glm5_next", "gpt_oss", "kimi_k3", "kimi_k25", "kimi_linear", "llama", "qwen3_moe",
           "qwen3_next", "qwen3_vl_moe")


def register(family: ModelFamily) -> ModelFamily:
    _FAMILIES[family.name] = family
    return family


def _load_builtin() -> None:
    # Each module registers its family when imported; importing them all every time (a
    # no-op once loaded) keeps the registry complete even if one was imported directly first.
    for name in BUILTIN:
        importlib.import_module(f"localmoe.models.{name}")


def families() -> list[ModelFamily]:
    _load_builtin()
    return list(_FAMILIES.values())


def supported_model_types() -> list[str]:
    return sorted({t for f in families() for t in f.model_types})


def runnable_model_types() -> list[str]:
    return sorted({t for f in families() if f.runnable for t in f.model_types})


def supported_gguf_architectures() -> list[str]:
    return sorted({a for f in families() for a in f.gguf_architectures})


def family_for_model_type(model_type: str, source: str = "config.json") -> ModelFamily:
    return _find(lambda f: model_type in f.model_types, lambda: f"{source}: model_type {model_type!r} is not supported; "
                 f"supported model types: {', '.join(supported_model_types())}")


def family_for_gguf(architecture: str, source: str = "GGUF file") -> ModelFamily:
    return _find(lambda f: architecture in f.gguf_architectures, lambda: f"{source}: GGUF architecture {architecture!r} "
                 f"is not supported; supported: {', '.join(supported_gguf_architectures())}")


def _find(match, unsupported) -> ModelFamily:
    """The first family `match(family)` accepts; UnsupportedModelError(unsupported()) when none does."""
    for family in families():
        if match(family):
            return family
    raise UnsupportedModelError(unsupported())
